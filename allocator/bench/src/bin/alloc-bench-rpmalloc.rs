//! The rpmalloc cells of `alloc-bench`, in their own binary: the `rpmalloc` crate interposes
//! `pthread_create` (to initialise its per-thread heaps), which must not affect other cells.
//! Usage: `alloc-bench-rpmalloc --cell rpmalloc <large|small> <threads> <steps>`.

use bemalloc_bench::cell::run_cell;
use bemalloc_bench::workload::Workload;
use bemalloc_bench::Global;

fn main() {
    bex_process::logging::init();
    let args: Vec<String> = std::env::args().skip(1).collect();
    let parsed = match args.as_slice() {
        [cell, name, w, t, s] if cell == "--cell" && name == "rpmalloc" => {
            Workload::parse(w).zip(t.parse::<usize>().ok()).zip(s.parse::<usize>().ok())
        }
        _ => None,
    };
    let Some(((workload, threads), steps)) = parsed else {
        eprintln!("usage: alloc-bench-rpmalloc --cell rpmalloc <large|small> <threads> <steps>");
        std::process::exit(2);
    };
    let r = run_cell("rpmalloc", &Global(rpmalloc::RpMalloc), workload, threads, steps);
    println!("{}", r.to_line());
}
