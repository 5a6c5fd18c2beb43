#![no_main]
libfuzzer_sys::fuzz_target!(|data: &[u8]| otter_hub_fuzz::harness::proto_json(data));
