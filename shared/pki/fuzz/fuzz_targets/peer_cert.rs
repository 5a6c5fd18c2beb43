#![no_main]
libfuzzer_sys::fuzz_target!(|data: &[u8]| otter_pki_fuzz::harness::peer_cert(data));
