//! The verbs conformance suite for the soft provider: both peers in one process, and across
//! two processes.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod conformance;

conformance::conformance_suite!(soft_threads, rpc_core::verbs::soft::Soft, Threads);
conformance::conformance_suite!(soft_procs, rpc_core::verbs::soft::Soft, Processes);

/// Soft only (a real NIC's rings are the kernel's and the device's): the deep SRQ a server
/// shard creates is walked without page faults, across processes.
#[test]
fn srq_walk_takes_no_page_faults() {
    conformance::harness::run::<rpc_core::verbs::soft::Soft>(
        conformance::harness::Mode::Processes,
        module_path!(),
        "srq_walk_takes_no_page_faults",
        conformance::srq::srq_walk_takes_no_page_faults::<rpc_core::verbs::soft::Soft>,
    );
}
