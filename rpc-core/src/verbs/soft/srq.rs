//! Shared receive queues (placeholder: being written on main).

use super::{Device, Soft, SoftCq, SoftQp};
use crate::verbs::{
    ErrorKind, PostError, QpCaps, RecvWr, Result, Srq, SrqCaps, Verb, VerbsError,
};
use std::sync::Arc;

/// A shared receive queue of the soft RNIC.
#[derive(Debug)]
pub struct SoftSrq {
    caps: SrqCaps,
}

fn unsupported(verb: Verb) -> VerbsError {
    VerbsError::new(verb, ErrorKind::InvalidArgument, "soft SRQ: not written yet")
}

impl SoftSrq {
    pub(crate) fn create(_dev: &Arc<Device>, _pd: u32, caps: SrqCaps) -> Result<SoftSrq> {
        let _ = SoftSrq { caps };
        Err(unsupported(Verb::CreateSrq))
    }

    pub(crate) fn create_qp(
        &self,
        _send_cq: &SoftCq,
        _recv_cq: &SoftCq,
        _caps: QpCaps,
    ) -> Result<SoftQp> {
        Err(unsupported(Verb::CreateQp))
    }
}

impl Srq for SoftSrq {
    fn srq_num(&self) -> u32 {
        0
    }
    fn caps(&self) -> SrqCaps {
        self.caps
    }
    fn arm_limit(&mut self, _limit: u32) -> Result<()> {
        Err(unsupported(Verb::ModifySrq))
    }
    unsafe fn post_recv(&mut self, _wrs: &[RecvWr<'_>]) -> std::result::Result<(), PostError> {
        Err(PostError {
            posted: 0,
            error: unsupported(Verb::PostSrqRecv),
        })
    }
}
