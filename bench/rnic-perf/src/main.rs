//! The `rnic-perf` binary; see `rnic-perf --help` and the `bex_rnic_perf` crate docs.

fn main() -> std::process::ExitCode {
    bex_process::logging::init();
    bex_rnic_perf::cli::main_entry()
}
