#![no_main]
libfuzzer_sys::fuzz_target!(|data: &[u8]| otter_hub_fuzz::harness::manifest_url(data));
