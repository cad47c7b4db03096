//! PLACEHOLDER until the soft provider lands (issue 2): every verb refuses with `Unsupported`.
#![allow(missing_docs, clippy::missing_errors_doc)]

use std::os::fd::{AsRawFd, RawFd};
use std::time::Duration;

use super::*;

/// The software RNIC.
#[derive(Debug)]
pub struct Soft;

/// Uninhabited placeholder object.
#[derive(Debug)]
pub enum Never {}

fn unsupported() -> VerbsError {
    VerbsError::new(
        Verb::OpenDevice,
        ErrorKind::Unsupported,
        "soft provider not built yet",
    )
}

impl Provider for Soft {
    const NAME: &'static str = "soft";
    const TAG: &'static str = "SOFT";
    type Context = Never;
    type Pd = Never;
    type Mr = Never;
    type CompChannel = Never;
    type Cq = Never;
    type Qp = Never;
    fn devices() -> Result<Vec<DeviceInfo>> {
        Ok(Vec::new())
    }
    fn open(_name: Option<&str>) -> Result<Never> {
        Err(unsupported())
    }
}

impl Context<Soft> for Never {
    fn info(&self) -> &DeviceInfo {
        match *self {}
    }
    fn caps(&self) -> &Caps {
        match *self {}
    }
    fn alloc_pd(&self) -> Result<Never> {
        match *self {}
    }
    fn create_comp_channel(&self) -> Result<Never> {
        match *self {}
    }
    fn create_cq(&self, _: u32, _: Option<&Never>) -> Result<Never> {
        match *self {}
    }
}
impl Pd<Soft> for Never {
    fn alloc_mr(&self, _: usize, _: Access) -> Result<Never> {
        match *self {}
    }
    unsafe fn reg_mr(&self, _: *mut u8, _: usize, _: Access) -> Result<Never> {
        match *self {}
    }
    fn create_qp(&self, _: &Never, _: &Never, _: QpCaps) -> Result<Never> {
        match *self {}
    }
}
impl Mr for Never {
    fn addr(&self) -> u64 {
        match *self {}
    }
    fn len(&self) -> usize {
        match *self {}
    }
    fn lkey(&self) -> u32 {
        match *self {}
    }
    fn rkey(&self) -> u32 {
        match *self {}
    }
    fn access(&self) -> Access {
        match *self {}
    }
}
impl AsRawFd for Never {
    fn as_raw_fd(&self) -> RawFd {
        match *self {}
    }
}
impl CompChannel for Never {
    fn wait(&self, _: Option<Duration>) -> Result<bool> {
        match *self {}
    }
    fn drain(&self) -> Result<u32> {
        match *self {}
    }
}
impl Cq for Never {
    fn poll(&mut self, _: &mut [Wc]) -> Result<usize> {
        match *self {}
    }
    fn req_notify(&self, _: bool) -> Result<()> {
        match *self {}
    }
    fn capacity(&self) -> u32 {
        match *self {}
    }
}
impl Qp for Never {
    fn qp_num(&self) -> u32 {
        match *self {}
    }
    fn state(&self) -> QpState {
        match *self {}
    }
    fn caps(&self) -> QpCaps {
        match *self {}
    }
    fn endpoint(&self) -> Endpoint {
        match *self {}
    }
    fn modify_to_init(&mut self, _: Access) -> Result<()> {
        match *self {}
    }
    fn modify_to_rtr(&mut self, _: &Endpoint, _: &ConnectAttr) -> Result<()> {
        match *self {}
    }
    fn modify_to_rts(&mut self, _: &ConnectAttr) -> Result<()> {
        match *self {}
    }
    fn modify_to_error(&mut self) -> Result<()> {
        match *self {}
    }
    fn modify_to_reset(&mut self) -> Result<()> {
        match *self {}
    }
    unsafe fn post_send(&mut self, _: &[SendWr<'_>]) -> Result<(), PostError> {
        match *self {}
    }
    unsafe fn post_recv(&mut self, _: &[RecvWr<'_>]) -> Result<(), PostError> {
        match *self {}
    }
}
