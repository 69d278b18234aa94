//! The soft HCA's WQE parser on arbitrary bytes: it must answer a work request or an error
//! (with the syndrome a NIC would report), never panic or read past the bytes it was given.
#![no_main]
use gdaki_layout::wqe::{WorkRequest, WqeView};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    if let Ok(view) = WqeView::new_checked(data) {
        match WorkRequest::parse(&view) {
            Ok(wr) => {
                // Whatever parsed must describe itself consistently.
                let _ = format!("{wr:?}");
            }
            Err(e) => {
                let _ = e.syndrome();
            }
        }
    }
});
