//! The fault matrix of the parameter server in deterministic simulation: every scenario over
//! a few seeds (debug build; `scripts/test.sh` runs more in release through the binary, and
//! `BEX_SEED=a..b` here runs those), and exact replay, in-process and across processes.

use std::process::Command;

use bex_simcluster::{run, Scenario};

fn check(s: Scenario) {
    for seed in bex_testkit::seed::seeds(0..3) {
        let r = run(s, seed);
        assert!(
            r.passed(),
            "{} seed {seed} failed ({}; or bex-simcluster --scenarios {} --seed {seed}): {:#?}",
            s.name(),
            bex_testkit::seed::replay(seed, "cargo test -p bex-simcluster --test scenarios"),
            s.name(),
            r
        );
    }
}

#[test]
fn loss_duplication_and_reordering_on_every_link() {
    check(Scenario::Loss);
}

#[test]
fn a_replica_shard_killed_and_restarted() {
    check(Scenario::ShardRestart);
}

#[test]
fn a_mini_pod_partitioned_and_healed() {
    check(Scenario::PodPartition);
}

#[test]
fn a_hung_replica_expires_by_keepalive() {
    check(Scenario::Hang);
}

#[test]
fn an_rdma_failure_falls_back_to_tcp_within_a_second_and_recovers() {
    check(Scenario::RdmaFallback);
    let r = run(Scenario::RdmaFallback, 11);
    assert!(r.fallback_ms.is_some_and(|ms| ms <= 1000), "{r:#?}");
    assert!(r.fallbacks > 0 && r.recoveries > 0 && r.tcp_calls > 0, "{r:#?}");
}

#[test]
fn a_client_restarted_with_the_same_id_has_its_pushes_applied() {
    check(Scenario::ClientRestart);
}

#[test]
fn a_training_shard_stopped_gracefully_and_restored_loses_nothing() {
    check(Scenario::TrainingRestart);
}

#[test]
fn a_training_shard_killed_catches_up_from_its_replica_and_loses_nothing() {
    check(Scenario::TrainingKill);
}

#[test]
fn a_bounded_admitting_expiring_table_keeps_the_same_rows_on_every_pod_through_a_kill_and_a_bootstrap(
) {
    check(Scenario::BoundedTrainingKill);
}

#[test]
fn a_dead_replica_is_quarantined_and_released_after_it_returns() {
    check(Scenario::Quarantine);
    let r = run(Scenario::Quarantine, 12);
    assert!(r.quarantines > 0, "{r:#?}");
}

#[test]
fn a_seed_replays_exactly_in_process_and_in_another_process() {
    let a = run(Scenario::Loss, 5);
    let b = run(Scenario::Loss, 5);
    assert_eq!(a, b, "the same seed, the same run");
    assert_ne!(a.fingerprint, run(Scenario::Loss, 6).fingerprint, "another seed, another run");
    let out = Command::new(env!("CARGO_BIN_EXE_bex-simcluster"))
        .args(["--scenarios", "loss", "--seed", "5"])
        .output()
        .expect("bex-simcluster runs");
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let there: serde_json::Value = serde_json::from_slice(&out.stdout).expect("one JSON report");
    assert_eq!(there["fingerprint"].as_u64(), Some(a.fingerprint), "replayed in another process");
}

#[test]
fn the_binary_rejects_an_unknown_scenario() {
    let out = Command::new(env!("CARGO_BIN_EXE_bex-simcluster"))
        .args(["--scenarios", "meteor-strike"])
        .output()
        .expect("bex-simcluster runs");
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("unknown scenario"));
}
