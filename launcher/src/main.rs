//! Placeholder until the binary lands (issue 6).
fn main() {
    eprintln!("not built yet");
    std::process::exit(1);
}
