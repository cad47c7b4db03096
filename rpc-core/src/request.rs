//! Requests and responses as handlers and callers see them: a message plus metadata (a small
//! ordered key/value map sent with the call) and, for requests, a timeout that travels with the
//! call as its deadline. Shapes follow tonic's `Request`/`Response`.

use std::fmt;
use std::time::Duration;

/// Largest encoded metadata block a frame may carry, in bytes.
pub const MAX_METADATA_LEN: usize = 4096;

/// Per-call metadata: an ordered list of keys and values, as gRPC defines them. Keys are
/// lower-case ASCII; a key ending in `-bin` carries any bytes (gRPC's binary headers, e.g.
/// `grpc-status-details-bin`), every other key a printable ASCII value (`0x20..=0x7e`), so
/// metadata ports to and from tonic's `MetadataMap` unchanged. Empty metadata allocates
/// nothing.
#[derive(Clone, Default, PartialEq, Eq)]
pub struct Metadata {
    /// In a block the server sends at a call's OK end that carries both headers and trailers
    /// ([`Metadata::join`]), an entry with an empty key separates them; no other block has
    /// one.
    entries: Vec<(String, Vec<u8>)>,
}

/// Why a metadata entry was refused.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct InvalidMetadata(pub &'static str);

impl fmt::Display for InvalidMetadata {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "invalid metadata: {}", self.0)
    }
}

impl std::error::Error for InvalidMetadata {}

impl Metadata {
    /// Empty metadata (no allocation).
    pub const fn new() -> Metadata {
        Metadata {
            entries: Vec::new(),
        }
    }

    /// One block of `headers` followed by `trailers`, for a call's OK end: encoded with a
    /// separator (an entry with an empty key and value, which no user key can be) between
    /// the sections, which [`Metadata::decode_sections`] splits again. Allocates nothing
    /// when `trailers` is empty and `headers` has room.
    ///
    /// # Errors
    /// When the two together exceed [`MAX_METADATA_LEN`] (they share one frame's budget).
    pub(crate) fn join(
        mut headers: Metadata,
        trailers: Metadata,
    ) -> Result<Metadata, InvalidMetadata> {
        headers.entries.push((String::new(), Vec::new()));
        headers.entries.extend(trailers.entries);
        if headers.encoded_len() > MAX_METADATA_LEN + entry_len("", &[]) {
            return Err(InvalidMetadata(
                "response metadata and trailers together larger than MAX_METADATA_LEN",
            ));
        }
        Ok(headers)
    }

    /// Number of entries.
    pub fn len(&self) -> usize {
        self.entries.len()
    }

    /// Whether there is no entry.
    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    /// Sets `key` to `value`, replacing an existing entry. Keys are lower-case ASCII letters,
    /// digits, `-`, `_` and `.`, 1 to 255 bytes (as gRPC's); values at most 65535 bytes, of
    /// printable ASCII unless the key ends in `-bin` (then any bytes: see
    /// [`Metadata::insert_bin`]).
    ///
    /// # Errors
    /// When the key or the value is invalid, or the encoded metadata would exceed
    /// [`MAX_METADATA_LEN`].
    pub fn insert(
        &mut self,
        key: impl Into<String>,
        value: impl Into<Vec<u8>>,
    ) -> Result<(), InvalidMetadata> {
        let key = key.into();
        let value = value.into();
        validate_key(&key)?;
        validate_value(&key, &value)?;
        if value.len() > u16::MAX as usize {
            return Err(InvalidMetadata("value longer than 65535 bytes"));
        }
        let existing = self.entries.iter().position(|(k, _)| *k == key);
        let old = existing.map_or(0, |i| entry_len(&self.entries[i].0, &self.entries[i].1));
        if self.encoded_len() - old + entry_len(&key, &value) > MAX_METADATA_LEN {
            return Err(InvalidMetadata("metadata larger than MAX_METADATA_LEN"));
        }
        match existing {
            Some(i) => self.entries[i].1 = value,
            None => self.entries.push((key, value)),
        }
        Ok(())
    }

    /// Sets the binary `key` (it must end in `-bin`) to `value`: gRPC's binary metadata, as
    /// tonic's `MetadataMap::insert_bin`.
    ///
    /// # Errors
    /// As [`Metadata::insert`]; when `key` does not end in `-bin`.
    pub fn insert_bin(
        &mut self,
        key: impl Into<String>,
        value: impl Into<Vec<u8>>,
    ) -> Result<(), InvalidMetadata> {
        let key = key.into();
        if !is_binary_key(&key) {
            return Err(InvalidMetadata(
                "a binary metadata key must end in \"-bin\"",
            ));
        }
        self.insert(key, value)
    }

    /// The value of `key`.
    pub fn get(&self, key: &str) -> Option<&[u8]> {
        self.entries
            .iter()
            .find(|(k, _)| k == key)
            .map(|(_, v)| v.as_slice())
    }

    /// The value of `key` as UTF-8 text.
    pub fn get_str(&self, key: &str) -> Option<&str> {
        self.get(key).and_then(|v| std::str::from_utf8(v).ok())
    }

    /// Removes `key`; returns its value.
    pub fn remove(&mut self, key: &str) -> Option<Vec<u8>> {
        let i = self.entries.iter().position(|(k, _)| k == key)?;
        Some(self.entries.remove(i).1)
    }

    /// Entries in insertion order.
    pub fn iter(&self) -> impl Iterator<Item = (&str, &[u8])> {
        self.entries.iter().map(|(k, v)| (k.as_str(), v.as_slice()))
    }

    /// Size of [`Metadata::encode`]'s output.
    pub fn encoded_len(&self) -> usize {
        if self.entries.is_empty() {
            return 0;
        }
        2 + self
            .entries
            .iter()
            .map(|(k, v)| entry_len(k, v))
            .sum::<usize>()
    }

    /// Encodes into `out` (which must hold [`Metadata::encoded_len`] bytes): a `u16` count,
    /// then per entry a `u8` key length, the key, a `u16` value length and the value, all
    /// little-endian. Empty metadata encodes to nothing. Returns the bytes written.
    pub fn encode(&self, out: &mut [u8]) -> usize {
        if self.entries.is_empty() {
            return 0;
        }
        let mut o = 0;
        out[o..o + 2].copy_from_slice(&(self.entries.len() as u16).to_le_bytes());
        o += 2;
        for (k, v) in &self.entries {
            out[o] = k.len() as u8;
            o += 1;
            out[o..o + k.len()].copy_from_slice(k.as_bytes());
            o += k.len();
            out[o..o + 2].copy_from_slice(&(v.len() as u16).to_le_bytes());
            o += 2;
            out[o..o + v.len()].copy_from_slice(v);
            o += v.len();
        }
        o
    }

    /// Decodes [`Metadata::encode`]'s output; `bytes` must be exactly one encoded block (an
    /// empty slice is empty metadata).
    ///
    /// # Errors
    /// On truncation, trailing bytes, invalid keys or duplicate keys.
    pub fn decode(bytes: &[u8]) -> Result<Metadata, InvalidMetadata> {
        if bytes.len() > MAX_METADATA_LEN {
            return Err(InvalidMetadata("metadata larger than MAX_METADATA_LEN"));
        }
        let md = Metadata::decode_block(bytes)?;
        if md.separator().is_some() {
            return Err(InvalidMetadata("key must be 1 to 255 bytes"));
        }
        Ok(md)
    }

    /// Decodes a block that may carry headers and trailers ([`Metadata::join`]): the headers
    /// and, when the block has the separator, the trailers.
    ///
    /// # Errors
    /// As [`Metadata::decode`]; more than one separator.
    pub(crate) fn decode_sections(
        bytes: &[u8],
    ) -> Result<(Metadata, Option<Metadata>), InvalidMetadata> {
        Ok(Metadata::decode_block(bytes)?.split())
    }

    /// A block decoded as [`Metadata::decode_sections`] does, split into its sections.
    pub(crate) fn split(mut self) -> (Metadata, Option<Metadata>) {
        match self.separator() {
            Some(at) => {
                let trailers = Metadata {
                    entries: self.entries.split_off(at + 1),
                };
                self.entries.pop();
                (self, Some(trailers))
            }
            None => (self, None),
        }
    }

    /// The index of the separator entry, if the block has one.
    fn separator(&self) -> Option<usize> {
        self.entries.iter().position(|(k, _)| k.is_empty())
    }

    /// Decodes a block that may hold a separator, keeping both sections in one value (split
    /// later with [`Metadata::split`]).
    pub(crate) fn decode_block(bytes: &[u8]) -> Result<Metadata, InvalidMetadata> {
        let mut md = Metadata::new();
        if bytes.is_empty() {
            return Ok(md);
        }
        if bytes.len() > MAX_METADATA_LEN + entry_len("", &[]) {
            return Err(InvalidMetadata("metadata larger than MAX_METADATA_LEN"));
        }
        let truncated = InvalidMetadata("metadata truncated");
        let count = u16::from_le_bytes([bytes[0], *bytes.get(1).ok_or(truncated.clone())?]);
        let mut o = 2;
        // Where the current section begins in `md.entries`.
        let mut section = 0;
        for _ in 0..count {
            let klen = *bytes.get(o).ok_or(truncated.clone())? as usize;
            o += 1;
            let key = bytes.get(o..o + klen).ok_or(truncated.clone())?;
            o += klen;
            let key = std::str::from_utf8(key).map_err(|_| InvalidMetadata("key is not ASCII"))?;
            let vl = bytes.get(o..o + 2).ok_or(truncated.clone())?;
            let vlen = u16::from_le_bytes([vl[0], vl[1]]) as usize;
            o += 2;
            if key.is_empty() && vlen == 0 {
                if section > 0 {
                    return Err(InvalidMetadata("more than one trailers separator"));
                }
                md.entries.push((String::new(), Vec::new()));
                section = md.entries.len();
                continue;
            }
            validate_key(key)?;
            let value = bytes.get(o..o + vlen).ok_or(truncated.clone())?;
            o += vlen;
            validate_value(key, value)?;
            // Keys are unique within a section (a trailer may repeat a header's key).
            if md.entries[section..].iter().any(|(k, _)| k == key) {
                return Err(InvalidMetadata("duplicate key"));
            }
            md.entries.push((key.to_owned(), value.to_vec()));
        }
        if o != bytes.len() {
            return Err(InvalidMetadata("trailing bytes after metadata"));
        }
        Ok(md)
    }
}

fn entry_len(k: &str, v: &[u8]) -> usize {
    1 + k.len() + 2 + v.len()
}

/// Whether `key` names binary metadata (gRPC's `-bin` suffix).
fn is_binary_key(key: &str) -> bool {
    key.ends_with("-bin")
}

/// Values of keys without `-bin` are printable ASCII, as gRPC's (and tonic's) ASCII values.
fn validate_value(key: &str, value: &[u8]) -> Result<(), InvalidMetadata> {
    if is_binary_key(key) || value.iter().all(|b| (0x20..=0x7e).contains(b)) {
        Ok(())
    } else {
        Err(InvalidMetadata(
            "the value of a key without \"-bin\" must be printable ASCII (0x20-0x7e); name \
             binary metadata with a key ending in \"-bin\"",
        ))
    }
}

fn validate_key(key: &str) -> Result<(), InvalidMetadata> {
    if key.is_empty() || key.len() > 255 {
        return Err(InvalidMetadata("key must be 1 to 255 bytes"));
    }
    let ok = key
        .bytes()
        .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || matches!(b, b'-' | b'_' | b'.'));
    if !ok {
        return Err(InvalidMetadata(
            "key must be lower-case ASCII letters, digits, '-', '_', '.'",
        ));
    }
    Ok(())
}

impl fmt::Debug for Metadata {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let mut m = f.debug_map();
        for (k, v) in &self.entries {
            match std::str::from_utf8(v) {
                Ok(s) => m.entry(k, &s),
                Err(_) => m.entry(k, v),
            };
        }
        m.finish()
    }
}

/// A request: the message, its metadata and an optional timeout.
#[derive(Debug, Clone, Default)]
pub struct Request<T> {
    metadata: Metadata,
    message: T,
    timeout: Option<Duration>,
    response_hint: Option<usize>,
    peer: Option<crate::server::Peer>,
    registered: Option<crate::client::RegHandle>,
}

impl<T> Request<T> {
    /// A request carrying `message` with empty metadata and no timeout.
    pub fn new(message: T) -> Request<T> {
        Request {
            metadata: Metadata::new(),
            message,
            timeout: None,
            response_hint: None,
            peer: None,
            registered: None,
        }
    }

    /// The message.
    pub fn get_ref(&self) -> &T {
        &self.message
    }

    /// The message, mutably.
    pub fn get_mut(&mut self) -> &mut T {
        &mut self.message
    }

    /// Takes the message out.
    pub fn into_inner(self) -> T {
        self.message
    }

    /// The metadata.
    pub fn metadata(&self) -> &Metadata {
        &self.metadata
    }

    /// The metadata, mutably.
    pub fn metadata_mut(&mut self) -> &mut Metadata {
        &mut self.metadata
    }

    /// Sets the timeout: the call fails with `DEADLINE_EXCEEDED` when it has not completed
    /// within `timeout`, and the server sees the deadline.
    pub fn set_timeout(&mut self, timeout: Duration) {
        self.timeout = Some(timeout);
    }

    /// The timeout; on the server side, the time that was left when the call arrived.
    pub fn timeout(&self) -> Option<Duration> {
        self.timeout
    }

    /// Sets or clears the timeout (what an interceptor returned).
    pub(crate) fn replace_timeout(&mut self, timeout: Option<Duration>) {
        self.timeout = timeout;
    }

    /// Tells the runtime how large the response will be (bytes of the encoded message). When it
    /// is above the eager threshold, the client lends a landing zone of that size with the
    /// request, and the server RDMA-WRITEs the response straight into it (one copy, no extra
    /// round trip). Without a hint a large response is fetched with an RDMA READ instead.
    pub fn set_response_size_hint(&mut self, bytes: usize) {
        self.response_hint = Some(bytes);
    }

    /// The response size hint.
    pub fn response_size_hint(&self) -> Option<usize> {
        self.response_hint
    }

    /// Server side: the connection this request arrived on, for one-sided READ and WRITE of
    /// memory the client registered and advertised in the request (explicit bulk handles).
    /// `None` on the client side.
    pub fn peer(&self) -> Option<&crate::server::Peer> {
        self.peer.as_ref()
    }

    pub(crate) fn set_peer(&mut self, peer: Option<crate::server::Peer>) {
        self.peer = peer;
    }

    /// Tells the client runtime that the message's large `bytes` field may lie in `region`
    /// (memory from [`crate::Channel::alloc_bytes`]): if it does, the request goes out
    /// without copying it; the server RDMA-READs it from there. The request keeps the region
    /// alive until the server has read it. Without this call, or when the field lies
    /// elsewhere, the message is encoded into a bulk buffer as usual (a copy).
    pub fn set_registered(&mut self, region: &crate::client::RegisteredBytes) {
        self.registered = Some(region.handle().clone());
    }

    pub(crate) fn take_registered(&mut self) -> Option<crate::client::RegHandle> {
        self.registered.take()
    }

    /// Splits into parts.
    pub fn into_parts(self) -> (Metadata, T, Option<Duration>) {
        (self.metadata, self.message, self.timeout)
    }

    /// Builds from parts.
    pub fn from_parts(metadata: Metadata, message: T, timeout: Option<Duration>) -> Request<T> {
        Request {
            metadata,
            message,
            timeout,
            response_hint: None,
            peer: None,
            registered: None,
        }
    }

    /// Maps the message, keeping metadata and timeout.
    pub fn map<U>(self, f: impl FnOnce(T) -> U) -> Request<U> {
        Request {
            metadata: self.metadata,
            message: f(self.message),
            timeout: self.timeout,
            response_hint: self.response_hint,
            peer: self.peer,
            registered: self.registered,
        }
    }
}

/// Conversion into a [`Request`]: a bare message or a request (as tonic's `IntoRequest`).
pub trait IntoRequest<T> {
    /// Wraps or passes through.
    fn into_request(self) -> Request<T>;
}

impl<T> IntoRequest<T> for T {
    fn into_request(self) -> Request<T> {
        Request::new(self)
    }
}

impl<T> IntoRequest<T> for Request<T> {
    fn into_request(self) -> Request<T> {
        self
    }
}

/// Conversion into a streaming request: a stream of messages or a request holding one (as
/// tonic's `IntoStreamingRequest`).
pub trait IntoStreamingRequest {
    /// The stream.
    type Stream: futures_core::Stream<Item = Self::Message> + Send + 'static;
    /// The message type.
    type Message;
    /// Wraps or passes through.
    fn into_streaming_request(self) -> Request<Self::Stream>;
}

impl<S> IntoStreamingRequest for S
where
    S: futures_core::Stream + Send + 'static,
{
    type Stream = S;
    type Message = S::Item;
    fn into_streaming_request(self) -> Request<S> {
        Request::new(self)
    }
}

impl<S> IntoStreamingRequest for Request<S>
where
    S: futures_core::Stream + Send + 'static,
{
    type Stream = S;
    type Message = S::Item;
    fn into_streaming_request(self) -> Request<S> {
        self
    }
}

/// A response: the message, its metadata (gRPC's response headers) and its trailers.
///
/// Trailers are metadata sent at the call's end, after the last message: a handler sets them
/// with [`Response::trailers_mut`] (for a stream, before it returns the stream) and the caller
/// reads them with [`Response::trailers`] (unary and client-streaming calls) or
/// [`crate::Streaming::trailers`] (server-streaming and bidi calls). Unlike tonic, whose
/// handlers cannot set trailers on an OK end and whose unary responses merge trailers into
/// the metadata, the two stay apart, as in gRPC. Metadata and trailers of one response share
/// [`MAX_METADATA_LEN`].
#[derive(Debug, Clone, Default)]
pub struct Response<T> {
    metadata: Metadata,
    message: T,
    trailers: Metadata,
}

impl<T> Response<T> {
    /// A response carrying `message` with empty metadata.
    pub fn new(message: T) -> Response<T> {
        Response {
            metadata: Metadata::new(),
            message,
            trailers: Metadata::new(),
        }
    }

    /// The message.
    pub fn get_ref(&self) -> &T {
        &self.message
    }

    /// The message, mutably.
    pub fn get_mut(&mut self) -> &mut T {
        &mut self.message
    }

    /// Takes the message out.
    pub fn into_inner(self) -> T {
        self.message
    }

    /// The metadata (response headers).
    pub fn metadata(&self) -> &Metadata {
        &self.metadata
    }

    /// The metadata, mutably.
    pub fn metadata_mut(&mut self) -> &mut Metadata {
        &mut self.metadata
    }

    /// The trailers: metadata sent after the message, at the call's OK end.
    pub fn trailers(&self) -> &Metadata {
        &self.trailers
    }

    /// The trailers, mutably (on the server: what the call's OK end carries).
    pub fn trailers_mut(&mut self) -> &mut Metadata {
        &mut self.trailers
    }

    /// Splits into parts (the trailers are dropped: see [`Response::into_all_parts`]).
    pub fn into_parts(self) -> (Metadata, T) {
        (self.metadata, self.message)
    }

    /// Splits into metadata, message and trailers.
    pub fn into_all_parts(self) -> (Metadata, T, Metadata) {
        (self.metadata, self.message, self.trailers)
    }

    /// Builds from parts.
    pub fn from_parts(metadata: Metadata, message: T) -> Response<T> {
        Response {
            metadata,
            message,
            trailers: Metadata::new(),
        }
    }

    /// A response as received: `metadata` is the frame's block, which holds the trailers
    /// after a separator when the server sent any.
    pub(crate) fn from_wire(metadata: Metadata, message: T) -> Response<T> {
        let (metadata, trailers) = metadata.split();
        Response {
            metadata,
            message,
            trailers: trailers.unwrap_or_default(),
        }
    }

    /// Sets the trailers (builder style).
    #[must_use]
    pub fn with_trailers(mut self, trailers: Metadata) -> Response<T> {
        self.trailers = trailers;
        self
    }

    /// Maps the message, keeping the metadata and trailers.
    pub fn map<U>(self, f: impl FnOnce(T) -> U) -> Response<U> {
        Response {
            metadata: self.metadata,
            message: f(self.message),
            trailers: self.trailers,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn metadata_round_trips() {
        let mut md = Metadata::new();
        md.insert("x-user", "alice").unwrap();
        md.insert("trace.id-bin", vec![0u8, 255, 3]).unwrap();
        md.insert("x-user", "bob").unwrap();
        let mut buf = vec![0u8; md.encoded_len()];
        assert_eq!(md.encode(&mut buf), buf.len());
        let back = Metadata::decode(&buf).unwrap();
        assert_eq!(back, md);
        assert_eq!(back.get_str("x-user"), Some("bob"));
    }

    #[test]
    fn headers_and_trailers_share_one_block() {
        let mut h = Metadata::new();
        h.insert("x-h", "1").unwrap();
        let mut t = Metadata::new();
        t.insert("x-t", "2").unwrap();
        // A trailer may repeat a header's key.
        t.insert("x-h", "3").unwrap();
        for (h, t) in [
            (h.clone(), t.clone()),
            (Metadata::new(), t.clone()),
            (h.clone(), Metadata::new()),
            (Metadata::new(), Metadata::new()),
        ] {
            let joined = Metadata::join(h.clone(), t.clone()).unwrap();
            let mut buf = vec![0u8; joined.encoded_len()];
            assert_eq!(joined.encode(&mut buf), buf.len());
            assert_eq!(Metadata::decode_sections(&buf), Ok((h, Some(t))));
            // The separator is no user key: strict decoding refuses it.
            assert!(Metadata::decode(&buf).is_err());
        }
        // A block without separator is one section.
        let mut buf = vec![0u8; h.encoded_len()];
        h.encode(&mut buf);
        assert_eq!(Metadata::decode_sections(&buf), Ok((h.clone(), None)));
        // Two separators, a separator with a value, a duplicate within a section.
        assert!(Metadata::decode_sections(&[2, 0, 0, 0, 0, 0, 0, 0]).is_err());
        assert!(Metadata::decode_sections(&[1, 0, 0, 1, 0, b'v']).is_err());
        assert!(Metadata::decode_sections(&[2, 0, 1, b'a', 0, 0, 1, b'a', 0, 0]).is_err());
        // Together they share one block's budget.
        let mut big = Metadata::new();
        big.insert("k-bin", vec![0u8; 3000]).unwrap();
        assert!(Metadata::join(big.clone(), big).is_err());
    }

    #[test]
    fn empty_metadata_encodes_to_nothing() {
        let md = Metadata::new();
        assert_eq!(md.encoded_len(), 0);
        assert_eq!(Metadata::decode(&[]).unwrap(), md);
    }

    #[test]
    fn bad_metadata_is_refused() {
        let mut md = Metadata::new();
        assert!(md.insert("Upper", "v").is_err());
        assert!(md.insert("", "v").is_err());
        assert!(md.insert("k-bin", vec![0u8; 70_000]).is_err());
        // Binary values only under -bin keys, as in gRPC.
        assert!(md.insert("k", vec![0u8, 1]).is_err());
        assert!(md.insert("k", "tab\there").is_err());
        assert!(md.insert("k", "caf\u{e9}").is_err());
        assert!(md.insert("k", "all printable ~ !").is_ok());
        assert!(md.insert("k-bin", vec![0u8, 1]).is_ok());
        assert!(md.insert_bin("k-bin", vec![0u8, 255]).is_ok());
        assert!(md.insert_bin("k", "v").is_err());
        // A peer's binary value under an ASCII key is refused on decode too.
        assert!(Metadata::decode(&[1, 0, 1, b'a', 1, 0, 0]).is_err());
        assert!(Metadata::decode(&[1, 0, 1, b'a', 1, 0, b'v']).is_ok());
        assert!(Metadata::decode(&[1, 0, 3, b'a']).is_err());
        assert!(Metadata::decode(&[1, 0, 1, b'a', 0, 0, 9]).is_err());
        assert!(Metadata::decode(&[2, 0, 1, b'a', 0, 0, 1, b'a', 0, 0]).is_err());
    }
}
