//! cargo-fuzz target: [`bex_fuzz_targets::ps_server`].
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| bex_fuzz_targets::ps_server(data));
