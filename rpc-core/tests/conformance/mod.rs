//! The verbs conformance suite: one set of cases, written once against the provider-neutral
//! verbs API, run for every provider — with both peers in one process (two threads, two
//! contexts) and with the peer in a second process (the test binary re-executes itself, the
//! sides talk over a TCP side channel).
//!
//! # Adding a provider
//!
//! One line in a test file of `rpc-core/tests/` (the file must declare `mod conformance;`):
//!
//! ```ignore
//! mod conformance;
//! conformance::conformance_suite!(ib_threads, rpc_core::verbs::ib::Ib, Threads);
//! conformance::conformance_suite!(ib_procs, rpc_core::verbs::ib::Ib, Processes);
//! ```
//!
//! Invoke it at the root of the test crate. A provider whose `open` fails with
//! `ErrorKind::NoDevice` is skipped (each test prints why and passes), so the suite can be
//! instantiated unconditionally under the provider's cargo feature; except where a device is
//! required (`SOFTROCE` or `RPC_IB_REQUIRE_DEVICE` set, see `harness::device_required`):
//! there a missing device fails every case.

// Each test binary that declares `mod conformance;` uses part of it.
#![allow(dead_code, unused_macros, unused_imports)]

pub mod cases;
pub mod edges;
pub mod harness;
pub mod srq;

/// Instantiates every case as a `#[test]` in module `$name`, for provider `$provider`, with
/// side B in a thread (`Threads`) or in a child process (`Processes`).
macro_rules! conformance_suite {
    ($name:ident, $provider:ty, $mode:ident) => {
        $crate::conformance::conformance_suite!(
            @cases $name, $provider, $mode,
            send_recv,
            send_sg_list,
            send_inline,
            write_read,
            write_with_imm,
            atomics,
            atomics_concurrent,
            remote_access_errors,
            window_loans,
            window_arguments,
            flush_after_failure,
            rnr_retry_exceeded,
            rnr_retry_forever,
            ordering,
            many_qps_one_cq,
            peer_killed,
            cq_overrun_prevented,
            post_before_rts,
            queue_full,
            forged_endpoint,
            bad_registration,
            local_protection_bounds,
            local_protection_pd,
            user_memory,
            channel_wakes_sleeper,
            zero_length_send,
            zero_length_write,
            zero_length_read,
            zero_length_sge,
            recv_too_small,
            read_then_send_fenced,
            read_then_send_unfenced,
            connect_attr_ranges,
            async_events_nonblocking,
            cq_resize,
            srq_many_qps,
            srq_empty_rnr,
            srq_limit_event,
            srq_qp_error_keeps_receives
        );
    };
    (@cases $name:ident, $provider:ty, $mode:ident, $($case:ident),* $(,)?) => {
        mod $name {
            $(
                #[test]
                fn $case() {
                    $crate::conformance::harness::run::<$provider>(
                        $crate::conformance::harness::Mode::$mode,
                        module_path!(),
                        stringify!($case),
                        $crate::conformance::cases::$case::<$provider>,
                    );
                }
            )*
        }
    };
}

pub(crate) use conformance_suite;
