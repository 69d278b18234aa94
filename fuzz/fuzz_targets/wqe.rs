//! The soft HCA's WQE parsers on arbitrary bytes: a send WQE must answer a work request or an
//! error (with the syndrome a NIC would report), never panic or read past the bytes it was
//! given, and an inline payload lies inside the WQE; a receive WQE answers a scatter list of at
//! most `MAX_RECV_SGES` buffers or an error.
#![no_main]
use gdaki_layout::recv;
use gdaki_layout::wqe::{Operation, Payload, WorkRequest, WqeView};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    if let Ok(list) = recv::parse(data) {
        assert!(list.as_slice().len() <= recv::MAX_RECV_SGES);
    }
    if let Ok(view) = WqeView::new_checked(data) {
        match WorkRequest::parse(&view) {
            Ok(wr) => {
                // Whatever parsed must describe itself consistently.
                let _ = format!("{wr:?}");
                if let Operation::Write {
                    payload: Payload::Inline { offset, len },
                    ..
                }
                | Operation::Send {
                    payload: Payload::Inline { offset, len },
                } = wr.op
                {
                    assert!(offset as usize + len as usize <= view.bytes().len());
                }
            }
            Err(e) => {
                let _ = e.syndrome();
            }
        }
    }
});
