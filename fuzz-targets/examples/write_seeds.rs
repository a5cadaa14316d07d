//! Writes every target's seeds as `<dir>/<target>/seed-<n>` (the cargo-fuzz corpora).
//!
//! Usage: `cargo run -p bex-fuzz-targets --example write_seeds -- <dir>`

use std::path::PathBuf;
use std::process::exit;

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let [dir] = args.as_slice() else {
        eprintln!(
            "usage: write_seeds <dir>\n  writes <dir>/<target>/seed-<n> for every fuzz target"
        );
        exit(2);
    };
    for (name, _) in bex_fuzz_targets::TARGETS {
        let d = PathBuf::from(dir).join(name);
        if let Err(e) = std::fs::create_dir_all(&d) {
            eprintln!("write_seeds: {}: {e}", d.display());
            exit(1);
        }
        let seeds = bex_fuzz_targets::seeds(name);
        for (i, s) in seeds.iter().enumerate() {
            let p = d.join(format!("seed-{i}"));
            if let Err(e) = std::fs::write(&p, s) {
                eprintln!("write_seeds: {}: {e}", p.display());
                exit(1);
            }
        }
        println!("{name}: {} seeds in {}", seeds.len(), d.display());
    }
}
