//! cargo-fuzz target: [`bex_fuzz_targets::roce_packet`].
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| bex_fuzz_targets::roce_packet(data));
