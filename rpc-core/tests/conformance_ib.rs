//! The verbs conformance suite on the ib provider (real RNICs, Soft-RoCE): both peers in one
//! process, and across two processes. Every case skips (and passes) on a host without an
//! RDMA device; `softroce/ci.sh` runs them in the Soft-RoCE VM.
#![cfg(feature = "ibverbs")]
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod conformance;

conformance::conformance_suite!(ib_threads, rpc_core::verbs::ib::Ib, Threads);
conformance::conformance_suite!(ib_procs, rpc_core::verbs::ib::Ib, Processes);
