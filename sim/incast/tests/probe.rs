//! The incast probe on the switched fabric: exact in virtual time for a seed.

use bex_incast::{run_probe, Params};

fn small(servers: usize, window: Option<u64>) -> Params {
    // A scaled-down switch: XOFF 128 KiB, 16 KiB responses.
    Params {
        servers,
        window,
        response_bytes: 16 << 10,
        xoff_bytes: 128 << 10,
        xon_bytes: 96 << 10,
        ..Params::default()
    }
}

#[test]
fn an_incast_beyond_xoff_pauses_losslessly() {
    let p = run_probe(&small(24, None)).expect("probe");
    assert!(p.pause_events > 0, "24 × 16 KiB at once must cross a 128 KiB XOFF: {p:?}");
    assert!(p.first_pause_us.is_some());
    assert_eq!(p.tail_drops, 0, "PFC is lossless");
    assert_eq!(p.retransmitted_packets, 0, "nothing lost, nothing resent");
}

#[test]
fn the_window_bounds_the_queue_and_avoids_the_pause() {
    let p = run_probe(&small(24, Some(4096))).expect("probe");
    assert_eq!(p.pause_events, 0, "{p:?}");
    // Each server has at most one 4 KiB fragment (plus headers and control) outstanding.
    assert!(p.worker_port_max_queue <= 24 * 5000, "queue {}", p.worker_port_max_queue);
}

#[test]
fn small_incasts_do_not_pause_and_runs_replay_exactly() {
    let a = run_probe(&small(4, None)).expect("probe");
    assert_eq!(a.pause_events, 0);
    let b = run_probe(&small(4, None)).expect("probe");
    assert_eq!(
        (a.p50_us, a.p99_us, a.worker_port_max_queue),
        (b.p50_us, b.p99_us, b.worker_port_max_queue)
    );
}

#[test]
fn the_victim_flow_loses_bandwidth_to_a_large_incast() {
    let alone = run_probe(&Params { victim: true, ..small(1, None) }).expect("probe");
    let crowded = run_probe(&Params { victim: true, ..small(32, None) }).expect("probe");
    // Both runs must have measured the victim: an absent figure read as 0 passed `c < a`.
    let a = alone.victim_gbps.expect("the victim ran alone");
    let c = crowded.victim_gbps.expect("the victim ran under incast");
    assert!(a > 0.0 && c > 0.0 && c < a, "victim alone {a} Gb/s, under incast {c} Gb/s");
}

#[test]
fn bad_parameters_are_errors() {
    assert!(run_probe(&Params { servers: 0, ..Params::default() }).is_err());
    assert!(run_probe(&Params { xon_bytes: 1 << 30, ..Params::default() }).is_err());
}
