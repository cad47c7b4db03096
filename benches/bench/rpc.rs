//! `cargo bench -p rpc-bench`: the harness in quick mode (`rpc-bench run --quick`), results in
//! `bench-out/` of the working directory.

fn main() -> std::process::ExitCode {
    rpc_bench::bench_main()
}
