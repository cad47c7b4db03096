#!/usr/bin/env bash
# softroce/pair.sh - the ib provider across two hosts: two Soft-RoCE VMs joined by a virtual
# Ethernet cable (softroce/vm.sh pair; rxe0 on eth0 of each, MTU 9000 = RoCE MTU 4096).
#
#   softroce/pair.sh [TEST-EXECUTABLES...]
#
# VM A (192.0.2.1) serves: the `serve_for_the_pair` entry of rpc_calls, rpc_multi_qp, interop,
# interop_flow and rpc_wire (RPC_TEST_SERVE, one port range each) and conformance_ib's peer
# server (`serve_pair_peers`, CONFORMANCE_SERVE). VM B (192.0.2.2) runs, in turn, the client
# side against them (RPC_TEST_REMOTE / CONFORMANCE_REMOTE):
#   1. conformance_ib's ib_pair:: cases (side B of each in VM A), then its ib_pair_wire::
#      case alone (VM B's packets delayed by tc netem: a duplicate READ after deregistration)
#   2. rpc_calls, rpc_multi_qp, interop, interop_flow: the cases that take their server
#      from the environment (see rpc-core/tests/common/remote.rs)
#   3. rpc_wire: MTU mismatch (VM B's NIC at 1500 = RoCE MTU 1024 against 4096), then
#      tc netem (1% / 10% loss, reordering, 1 ms delay: figures in lines `NETEM |`), the
#      link down for 2 s and for good (lines `LINK |`)
# Exit: the first failure in VM B, else VM A's (a server that saw calls left over fails).
#
# Without arguments the test executables are built (cargo, --features ibverbs) first.
# Run it from anywhere; the programs run in rpc-core/ (as cargo runs tests).
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)

exes=("$@")
if [[ ${#exes[@]} -eq 0 ]]; then
  while IFS= read -r exe; do exes+=("$exe"); done < <(
    cd "$ROOT" && cargo test -p rpc-core --features ibverbs --no-run --message-format=json 2>/dev/null |
      sed -n 's/.*"executable":"\([^"]*\)".*/\1/p')
fi
pick() {  # the test executable of target $1
  local e
  for e in "${exes[@]}"; do
    [[ "$(basename "$e")" =~ ^$1-[0-9a-f]+$ ]] && { echo "$e"; return 0; }
  done
  echo "softroce/pair: no test executable for $1" >&2
  return 1
}
calls=$(pick rpc_calls) multi=$(pick rpc_multi_qp) interop=$(pick interop)
flow=$(pick interop_flow) wire=$(pick rpc_wire) conf=$(pick conformance_ib)

A=192.0.2.1
# The RPC suites' transport timeout for emulated VMs (see softroce/ci.sh); rpc_wire's fault
# cases and the conformance cases keep the default timers they measure.
SLOW=RPC_IB_TIMEOUT=18
SERVE=(serve_for_the_pair --exact --ignored --nocapture)
# VM A: every server at once (each until VM B is done).
a=(/usr/bin/env RPC_TEST_SERVE=$A:7100 $SLOW "$calls" "${SERVE[@]}" :::
   /usr/bin/env RPC_TEST_SERVE=$A:7200 $SLOW "$multi" "${SERVE[@]}" :::
   /usr/bin/env RPC_TEST_SERVE=$A:7300 $SLOW "$interop" "${SERVE[@]}" :::
   /usr/bin/env RPC_TEST_SERVE=$A:7400 $SLOW "$flow" "${SERVE[@]}" :::
   /usr/bin/env RPC_TEST_SERVE=$A:7500 "$wire" "${SERVE[@]}" :::
   /usr/bin/env CONFORMANCE_SERVE=$A:7600 "$conf" serve_pair_peers --exact --ignored --nocapture)

# The conformance cases rxe departs from (see softroce/ci.sh and README-ib.md).
CONF_SKIPS=(--skip local_protection_pd --skip recv_too_small)
# rpc_calls: the cases that take a Target (the rest need this process's server).
CALLS=(echo_sizes_thread_poller_async echo_sizes_caller_poller_blocking
       deadline_exceeded_thread_poller_async unknown_method_is_unimplemented
       handler_errors_arrive_with_code_message_and_trailers metadata_round_trips_on_every_path
       pipeline_thread_poller smallest_rings_under_load many_connections_over_several_shards
       pending_requests_thread_poller_async pending_requests_caller_poller_blocking)
# rpc_multi_qp: every case, the QP negotiation and the striped transfers (which need the
# fence of rpc-core/src/link/stripe.rs across hosts: a retransmitted READ request on a data
# QP could otherwise reach the lender after it revoked the key).
MULTI=(--skip serve_for_the_pair)
# interop / interop_flow: those reading server-side probes or counters run locally; skip them.
INTEROP_LOCAL=(--skip cancel_after_begin --skip cancel_after_first_response
               --skip timeout_on_sleeping_server)
FLOW_LOCAL=(--skip slow_consumer_slows_the_producer --skip fast_producer_stays_bounded
            --skip a_stalled_stream_blocks_no_other_call --skip empty_streams_both_ways
            --skip dropping_a_stream_stops_its_producer
            --skip many_stalled_streams_do_not_starve_the_connection
            --skip a_deadline_ends_a_slow_server_stream)
b=(/usr/bin/env CONFORMANCE_REMOTE=$A:7600 "$conf" ib_pair:: "${CONF_SKIPS[@]}" :::
   /usr/bin/env CONFORMANCE_REMOTE=$A:7600 "$conf" ib_pair_wire:: --test-threads=1 --nocapture :::
   /usr/bin/env RPC_TEST_REMOTE=$A:7100 $SLOW "$calls" "${CALLS[@]}" :::
   /usr/bin/env RPC_TEST_REMOTE=$A:7200 $SLOW "$multi" "${MULTI[@]}" :::
   /usr/bin/env RPC_TEST_REMOTE=$A:7300 $SLOW "$interop" "${INTEROP_LOCAL[@]}" :::
   /usr/bin/env RPC_TEST_REMOTE=$A:7400 $SLOW "$flow" "${FLOW_LOCAL[@]}" :::
   /usr/bin/env RPC_TEST_REMOTE=$A:7500 "$wire" mtu_mismatch_negotiates_down netem_figures
     link_flap link_down_for_good --ignored --nocapture --test-threads=1)

# The programs are staged through SOFTROCE_EXTRA (`env` is the program of each line).
cd "$ROOT/rpc-core"
SOFTROCE_EXTRA="${SOFTROCE_EXTRA:-} $calls $multi $interop $flow $wire $conf" RPC_PROVIDER=ib \
  exec "$ROOT/softroce/vm.sh" pair "${a[@]}" --vm-b "${b[@]}"
