//! The `ib` provider: real RNICs through rdma-sys (issue 5). Not written yet.
