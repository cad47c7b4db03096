//! The verbs conformance suite for the soft provider: both peers in one process, and across
//! two processes.

mod conformance;

conformance::conformance_suite!(soft_threads, rpc_core::verbs::soft::Soft, Threads);
conformance::conformance_suite!(soft_procs, rpc_core::verbs::soft::Soft, Processes);
