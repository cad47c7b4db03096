//! The verbs conformance suite on the ib provider (real RNICs, Soft-RoCE): both peers in one
//! process, and across two processes. Every case skips (and passes) on a host without an
//! RDMA device, except inside the Soft-RoCE VM (`softroce/ci.sh`, which sets `SOFTROCE`) or
//! with `RPC_IB_REQUIRE_DEVICE=1`, where a missing device fails it.
#![cfg(feature = "ibverbs")]
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod conformance;

conformance::conformance_suite!(ib_threads, rpc_core::verbs::ib::Ib, Threads);
conformance::conformance_suite!(ib_procs, rpc_core::verbs::ib::Ib, Processes);
