//! Loopback ports for tests: one block of free ports per test process (checked free below the
//! ephemeral range when first asked for), split into equal parts by salt, one salt per test,
//! so parallel tests in one process never collide and separate processes rarely do.

use std::sync::OnceLock;

/// The first port of part `salt` of a block of `parts` parts of `per_part` ports each. Every
/// call in one process must pass the same `parts` and `per_part` (the block is taken once).
pub fn base_port(salt: u16, per_part: u16, parts: u16) -> u16 {
    static BLOCK: OnceLock<(u16, u16, u16)> = OnceLock::new();
    let &(base, per, n) = BLOCK.get_or_init(|| {
        let total = per_part.checked_mul(parts).expect("a port block fits in u16");
        (bex_process::free_local_ports(total).expect("free loopback ports"), per_part, parts)
    });
    assert_eq!((per, n), (per_part, parts), "every test of a process asks for the same block");
    assert!(salt < parts, "salt {salt} is outside the block of {parts}");
    base + salt * per_part
}
