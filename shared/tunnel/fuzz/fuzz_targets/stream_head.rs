#![no_main]
libfuzzer_sys::fuzz_target!(|data: &[u8]| otter_tunnel_fuzz::harness::stream_head(data));
