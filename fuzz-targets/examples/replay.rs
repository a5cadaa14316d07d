//! Runs one fuzz target on input files (a crash artifact, a corpus), without cargo-fuzz.
//!
//! Usage: `cargo run -p bex-fuzz-targets --example replay -- <target> <file>...`

use std::process::exit;

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let names: Vec<&str> = bex_fuzz_targets::TARGETS.iter().map(|t| t.0).collect();
    let Some((name, files)) = args.split_first().filter(|(_, f)| !f.is_empty()) else {
        eprintln!("usage: replay <target> <file>...\n  targets: {}", names.join(" "));
        exit(2);
    };
    let Some(&(_, target)) = bex_fuzz_targets::TARGETS.iter().find(|t| t.0 == name) else {
        eprintln!("replay: unknown target {name} (one of: {})", names.join(" "));
        exit(2);
    };
    for f in files {
        let data = std::fs::read(f).unwrap_or_else(|e| {
            eprintln!("replay: {f}: {e}");
            exit(1);
        });
        println!("{name} on {f} ({} bytes)", data.len());
        target(&data);
    }
    println!("no failure");
}
