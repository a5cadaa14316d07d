//! The `bex-perf` binary; see `bex-perf --help` and the `bex_perf` crate docs.

fn main() -> std::process::ExitCode {
    bex_process::logging::init();
    bex_perf::cli::main_entry()
}
