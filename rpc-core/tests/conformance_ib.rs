//! The verbs conformance suite on the ib provider (real RNICs, Soft-RoCE): both peers in one
//! process, and across two processes. Every case skips (and passes) on a host without an
//! RDMA device, except inside the Soft-RoCE VM (`softroce/ci.sh`, which sets `SOFTROCE`) or
//! with `RPC_IB_REQUIRE_DEVICE=1`, where a missing device fails it.
#![cfg(feature = "ibverbs")]
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod conformance;

conformance::conformance_suite!(ib_threads, rpc_core::verbs::ib::Ib, Threads);
conformance::conformance_suite!(ib_procs, rpc_core::verbs::ib::Ib, Processes);
// Across two hosts (two VMs in softroce/ci.sh): side B on the other host, started by its
// `serve_pair_peers`; skips without CONFORMANCE_REMOTE.
conformance::conformance_suite!(ib_pair, rpc_core::verbs::ib::Ib, Remote);

// Across two hosts, with this host's packets delayed by `tc netem` (run alone, by
// softroce/pair.sh): the hazard striped READs fence against. Skips without CONFORMANCE_REMOTE.
mod ib_pair_wire {
    #[test]
    fn read_replayed_after_deregistration() {
        super::conformance::harness::run::<rpc_core::verbs::ib::Ib>(
            super::conformance::harness::Mode::Remote,
            module_path!(),
            "read_replayed_after_deregistration",
            super::conformance::edges::read_replayed_after_deregistration,
        );
    }
}

/// The peer server of `ib_pair` (in the other host, with `CONFORMANCE_SERVE=ip:port`).
#[test]
#[ignore = "the peer side of a two-host run (softroce/vm.sh pair sets CONFORMANCE_SERVE)"]
fn serve_pair_peers() {
    conformance::harness::serve_peers();
}
