//! cargo-fuzz target: [`bex_fuzz_targets::rpc_replies`].
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| bex_fuzz_targets::rpc_replies(data));
