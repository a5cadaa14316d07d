//! The `ps-bench` binary; see `ps-bench --help` and the `bex_ps_bench` crate docs.

fn main() -> std::process::ExitCode {
    bex_process::logging::init();
    bex_ps_bench::cli::main_entry()
}
