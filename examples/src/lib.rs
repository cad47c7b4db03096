//! Shared helpers of the examples: the code generated from `proto/greeter.proto`,
//! `proto/kv.proto` and `proto/bulk.proto` (see `build.rs`), the service implementations the
//! example binaries serve, and small helpers.

use std::collections::BTreeMap;
use std::sync::RwLock;
use std::sync::atomic::{AtomicU64, Ordering};

use bytes::Bytes;
use rpc_core::{Request, Response, Status};

/// `proto/greeter.proto`: package `helloworld`.
pub mod helloworld {
    include!(concat!(env!("OUT_DIR"), "/helloworld.rs"));
}

/// `proto/kv.proto`: package `kv`.
pub mod kv {
    include!(concat!(env!("OUT_DIR"), "/kv.rs"));
}

/// `proto/bulk.proto`: package `bulk`.
pub mod bulk {
    include!(concat!(env!("OUT_DIR"), "/bulk.rs"));
}

/// `proto/mesh.proto`: package `mesh` (the microservices example).
pub mod mesh {
    include!(concat!(env!("OUT_DIR"), "/mesh.rs"));
}

/// Logs to stderr, filtered by `RUST_LOG` (default `info`).
pub fn init_tracing() {
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info"));
    let _ = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .try_init();
}

// ---------------------------------------------------------------------------------------------
// Greeter

/// The greeter: answers `Hello <name>!`, refuses empty names.
#[derive(Debug, Default)]
pub struct Greeter {
    calls: AtomicU64,
}

impl Greeter {
    /// Calls served so far.
    pub fn calls(&self) -> u64 {
        self.calls.load(Ordering::Relaxed)
    }
}

impl helloworld::greeter_server::Greeter for Greeter {
    async fn say_hello(
        &self,
        request: Request<helloworld::HelloRequest>,
    ) -> Result<Response<helloworld::HelloReply>, Status> {
        self.calls.fetch_add(1, Ordering::Relaxed);
        let name = &request.get_ref().name;
        if name.is_empty() {
            return Err(Status::invalid_argument("name must not be empty"));
        }
        Ok(Response::new(helloworld::HelloReply {
            message: format!("Hello {name}!"),
        }))
    }
}

// ---------------------------------------------------------------------------------------------
// Key-value store

/// Default largest value the store accepts.
pub const DEFAULT_MAX_VALUE: usize = 64 << 20;
/// Entries a `List` returns when the request asks for 0.
pub const DEFAULT_LIST_LIMIT: u32 = 100;
/// Most entries one `List` returns.
pub const MAX_LIST_LIMIT: u32 = 10_000;
/// Longest key, in bytes.
pub const MAX_KEY_LEN: usize = 1024;

/// An in-memory key-value store (a `BTreeMap` behind a lock: example code, not the hot path
/// of the framework).
#[derive(Debug)]
pub struct KvStore {
    map: RwLock<BTreeMap<String, Bytes>>,
    max_value: usize,
}

impl KvStore {
    /// An empty store refusing values above `max_value` bytes.
    pub fn new(max_value: usize) -> Self {
        KvStore {
            map: RwLock::new(BTreeMap::new()),
            max_value,
        }
    }

    fn check_key(key: &str) -> Result<(), Status> {
        if key.is_empty() {
            return Err(Status::invalid_argument("key must not be empty"));
        }
        if key.len() > MAX_KEY_LEN {
            return Err(Status::invalid_argument(format!(
                "key is {} bytes, the limit is {MAX_KEY_LEN}",
                key.len()
            )));
        }
        Ok(())
    }

    fn read(&self) -> Result<std::sync::RwLockReadGuard<'_, BTreeMap<String, Bytes>>, Status> {
        self.map
            .read()
            .map_err(|_| Status::internal("store lock poisoned"))
    }

    fn write(&self) -> Result<std::sync::RwLockWriteGuard<'_, BTreeMap<String, Bytes>>, Status> {
        self.map
            .write()
            .map_err(|_| Status::internal("store lock poisoned"))
    }
}

impl Default for KvStore {
    fn default() -> Self {
        KvStore::new(DEFAULT_MAX_VALUE)
    }
}

impl kv::kv_server::Kv for KvStore {
    async fn put(
        &self,
        request: Request<kv::PutRequest>,
    ) -> Result<Response<kv::PutReply>, Status> {
        let kv::PutRequest { key, value } = request.into_inner();
        Self::check_key(&key)?;
        if value.len() > self.max_value {
            return Err(Status::resource_exhausted(format!(
                "value is {} bytes, the store's limit is {}",
                value.len(),
                self.max_value
            )));
        }
        let replaced = self.write()?.insert(key, value).is_some();
        Ok(Response::new(kv::PutReply { replaced }))
    }

    async fn get(
        &self,
        request: Request<kv::GetRequest>,
    ) -> Result<Response<kv::GetReply>, Status> {
        let key = &request.get_ref().key;
        Self::check_key(key)?;
        match self.read()?.get(key) {
            // `Bytes` clones share the buffer: no copy of the value here.
            Some(value) => Ok(Response::new(kv::GetReply {
                value: value.clone(),
            })),
            None => Err(Status::not_found(format!("no key {key:?}"))),
        }
    }

    async fn delete(
        &self,
        request: Request<kv::DeleteRequest>,
    ) -> Result<Response<kv::DeleteReply>, Status> {
        let key = &request.get_ref().key;
        Self::check_key(key)?;
        let existed = self.write()?.remove(key).is_some();
        Ok(Response::new(kv::DeleteReply { existed }))
    }

    async fn list(
        &self,
        request: Request<kv::ListRequest>,
    ) -> Result<Response<kv::ListReply>, Status> {
        let r = request.into_inner();
        let limit = match r.limit {
            0 => DEFAULT_LIST_LIMIT,
            n => n.min(MAX_LIST_LIMIT),
        } as usize;
        let map = self.read()?;
        let start = if r.start_after.is_empty() {
            std::ops::Bound::Included(r.prefix.clone())
        } else {
            std::ops::Bound::Excluded(r.start_after.clone())
        };
        let mut matching = map
            .range((start, std::ops::Bound::Unbounded))
            .skip_while(|(k, _)| !k.starts_with(&r.prefix) && k.as_str() < r.prefix.as_str())
            .take_while(|(k, _)| k.starts_with(&r.prefix));
        let entries: Vec<kv::list_reply::Entry> = matching
            .by_ref()
            .take(limit)
            .map(|(k, v)| kv::list_reply::Entry {
                key: k.clone(),
                size: v.len() as u64,
            })
            .collect();
        let truncated = matching.next().is_some();
        Ok(Response::new(kv::ListReply { entries, truncated }))
    }
}

// ---------------------------------------------------------------------------------------------
// Bulk

/// 64-bit checksum of `bytes`: FNV-1a over 8-byte little-endian words (the tail zero-padded),
/// then the length. Fast enough for GiB buffers; not cryptographic.
pub fn checksum(bytes: &[u8]) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    let mut words = bytes.chunks_exact(8);
    for w in words.by_ref() {
        let mut a = [0u8; 8];
        a.copy_from_slice(w);
        h ^= u64::from_le_bytes(a);
        h = h.wrapping_mul(0x0000_0100_0000_01b3);
    }
    let rest = words.remainder();
    if !rest.is_empty() {
        let mut a = [0u8; 8];
        a[..rest.len()].copy_from_slice(rest);
        h ^= u64::from_le_bytes(a);
        h = h.wrapping_mul(0x0000_0100_0000_01b3);
    }
    h ^ bytes.len() as u64
}

/// Fills `buf` with a pattern derived from `seed` (xorshift64*, 8 bytes at a time).
pub fn fill_pattern(buf: &mut [u8], seed: u64) {
    let mut x = seed | 1;
    for chunk in buf.chunks_mut(8) {
        x ^= x >> 12;
        x ^= x << 25;
        x ^= x >> 27;
        let v = x.wrapping_mul(0x2545_f491_4f6c_dd1d).to_le_bytes();
        chunk.copy_from_slice(&v[..chunk.len()]);
    }
}

/// Parses a size: `4096`, `64k`, `64KiB`, `16M`, `64MiB`, `1G` (powers of 1024).
///
/// # Errors
/// When the text is not a number with an optional unit.
pub fn parse_size(text: &str) -> Result<usize, String> {
    let t = text.trim();
    let digits = t.chars().take_while(char::is_ascii_digit).count();
    let (n, unit) = t.split_at(digits);
    let n: usize = n
        .parse()
        .map_err(|_| format!("{text:?} is not a size (like 4096, 64KiB, 64MiB)"))?;
    let shift = match unit.trim().to_ascii_lowercase().as_str() {
        "" | "b" => 0,
        "k" | "kb" | "kib" => 10,
        "m" | "mb" | "mib" => 20,
        "g" | "gb" | "gib" => 30,
        other => return Err(format!("unknown size unit {other:?} in {text:?}")),
    };
    n.checked_mul(1 << shift)
        .ok_or_else(|| format!("{text:?} is too large"))
}

/// `bytes` as `12.3 MiB`.
pub fn human(bytes: u64) -> String {
    const UNITS: [&str; 5] = ["B", "KiB", "MiB", "GiB", "TiB"];
    let mut v = bytes as f64;
    let mut u = 0;
    while v >= 1024.0 && u + 1 < UNITS.len() {
        v /= 1024.0;
        u += 1;
    }
    if u == 0 {
        format!("{bytes} B")
    } else {
        format!("{v:.1} {}", UNITS[u])
    }
}

/// Throughput of `bytes` moved in `elapsed`, as `1.23 GB/s`.
pub fn rate(bytes: u64, elapsed: std::time::Duration) -> String {
    let s = elapsed.as_secs_f64().max(1e-9);
    format!("{:.2} GB/s", bytes as f64 / s / 1e9)
}

#[cfg(test)]
mod tests {
    use super::*;
    use kv::kv_server::Kv as _;

    #[test]
    fn sizes_parse() {
        assert_eq!(parse_size("4096"), Ok(4096));
        assert_eq!(parse_size("64KiB"), Ok(64 << 10));
        assert_eq!(parse_size("64m"), Ok(64 << 20));
        assert!(parse_size("lots").is_err());
        assert!(parse_size("1 parsec").is_err());
    }

    #[test]
    fn checksum_depends_on_every_byte_and_the_length() {
        let mut a = vec![0u8; 1001];
        fill_pattern(&mut a, 7);
        let c = checksum(&a);
        a[1000] ^= 1;
        assert_ne!(checksum(&a), c);
        assert_ne!(checksum(&[0u8; 8]), checksum(&[0u8; 9]));
    }

    #[tokio::test]
    async fn the_store_puts_gets_lists_and_deletes() {
        let s = KvStore::new(10);
        let put = |k: &str, v: &'static [u8]| {
            Request::new(kv::PutRequest {
                key: k.into(),
                value: Bytes::from_static(v),
            })
        };
        for k in ["a/1", "a/2", "a/3", "b/1"] {
            s.put(put(k, b"v")).await.unwrap();
        }
        assert!(s.put(put("a/1", b"w")).await.unwrap().get_ref().replaced);
        let too_big = s.put(put("x", b"01234567890")).await.unwrap_err();
        assert_eq!(too_big.code(), rpc_core::Code::ResourceExhausted);
        let got = s
            .get(Request::new(kv::GetRequest { key: "a/1".into() }))
            .await
            .unwrap();
        assert_eq!(got.get_ref().value.as_ref(), b"w");
        let list = |prefix: &str, after: &str, limit| {
            Request::new(kv::ListRequest {
                prefix: prefix.into(),
                start_after: after.into(),
                limit,
            })
        };
        let page = s.list(list("a/", "", 2)).await.unwrap().into_inner();
        let keys: Vec<_> = page.entries.iter().map(|e| e.key.as_str()).collect();
        assert_eq!((keys, page.truncated), (vec!["a/1", "a/2"], true));
        let page = s.list(list("a/", "a/2", 2)).await.unwrap().into_inner();
        let keys: Vec<_> = page.entries.iter().map(|e| e.key.as_str()).collect();
        assert_eq!((keys, page.truncated), (vec!["a/3"], false));
        let del = s
            .delete(Request::new(kv::DeleteRequest { key: "a/1".into() }))
            .await
            .unwrap();
        assert!(del.get_ref().existed);
        let missing = s
            .get(Request::new(kv::GetRequest { key: "a/1".into() }))
            .await
            .unwrap_err();
        assert_eq!(missing.code(), rpc_core::Code::NotFound);
    }
}
