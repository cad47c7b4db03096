//! `rpc-bench`: see the library documentation, or `rpc-bench --help`.

fn main() -> std::process::ExitCode {
    rpc_bench::main_with(std::env::args_os().collect())
}
