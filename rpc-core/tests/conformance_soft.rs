//! The verbs conformance suite for the soft provider: both peers in one process, and across
//! two processes.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod conformance;

conformance::conformance_suite!(soft_threads, rpc_core::verbs::soft::Soft, Threads);
conformance::conformance_suite!(soft_procs, rpc_core::verbs::soft::Soft, Processes);
