//! Encoding a request: eager into a send slot, or by rendezvous from a bulk buffer (with a
//! large `bytes` field referenced where it lies in the user's registered region), and lending
//! those buffers to the server when the request goes out.

use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

use crate::buf::{BulkBuf, EncodeMsg, Gather, NoMsg, Piece, encode::MAX_PIECES};
use crate::call::desc;
use crate::client::RegHandle;
use crate::link::Staged;
use crate::method::{CallKind, MethodDesc};
use crate::verbs::{Access, Mr, Provider};
use crate::wire::{BulkDesc, MAX_BULK_PIECES, MAX_HEADER_LEN};
use crate::{Metadata, Status};

use super::submit::SlotLoan;
use super::{ClientCore, Driver, Gathered, Large, Staging, Submission};

/// A request's `bytes` field at least this large that lies in the registered region the
/// request names is sent from there (the server READs it) instead of being copied.
const ZERO_COPY_REQUEST_MIN: usize = 16 << 10;

/// The staging buffer first tried for the copied part of such a request (the smallest bulk
/// buffer); a larger one is taken when the small fields need more.
const STAGE_FIRST: usize = 4 << 10;

const _: () = assert!(MAX_PIECES <= MAX_BULK_PIECES);

impl<P: Provider> ClientCore<P> {
    /// Encodes the request: eager into a send slot, or by rendezvous from a bulk buffer.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn prepare(
        &self,
        slot: SlotLoan<'_, P>,
        method: &MethodDesc,
        metadata: &Metadata,
        msg: &dyn EncodeMsg,
        timeout: Option<Duration>,
        landing_hint: Option<usize>,
        registered: Option<RegHandle>,
    ) -> Result<Submission<P>, Status> {
        let len = msg.encoded_len();
        let md_len = metadata.encoded_len();
        if len as u64 > self.max_message {
            return Err(Status::resource_exhausted(format!(
                "request of {len} bytes exceeds the {} byte message limit",
                self.max_message
            )));
        }
        if MAX_HEADER_LEN + md_len > self.eager_limit {
            return Err(Status::resource_exhausted(
                "request metadata too large for a frame",
            ));
        }
        let eager = MAX_HEADER_LEN + md_len + len <= self.eager_limit;
        let mut bulk = None;
        let mut gathered = None;
        let staged = if eager {
            self.stage(slot, metadata, msg)?
        } else {
            // Registered memory of this connection's pool may be referenced; other memory
            // (another connection's, after a reconnect) is copied.
            let own = Arc::as_ptr(&self.bulk) as *const () as usize;
            match registered
                .filter(|r| r.0.pool_id() == own)
                .map(|r| self.encode_gathered(msg, len, r))
                .transpose()?
                .flatten()
            {
                Some((buf, g)) => {
                    bulk = Some(buf);
                    gathered = Some(g);
                }
                None => {
                    let mut buf = self
                        .bulk
                        .get(len)
                        .map_err(|e| Status::resource_exhausted(format!("bulk buffer: {e}")))?;
                    if msg.encode_into(buf.as_mut_slice()).is_none() {
                        return Err(Status::internal("request encoding failed"));
                    }
                    bulk = Some(buf);
                }
            }
            self.counters.bulk_requests.fetch_add(1, Ordering::Relaxed);
            self.stage(slot, metadata, &NoMsg)?
        };
        // Without the caller's hint, what the method's last large response needed (only calls
        // with one response: a stream's messages never use the zone).
        let landing_hint = landing_hint.or_else(|| match method.kind {
            CallKind::Unary | CallKind::ClientStreaming => self.sizes.hint(method.id),
            _ => None,
        });
        let landing = match landing_hint {
            // No zone for a response the caller could not accept anyway.
            Some(n) if MAX_HEADER_LEN + n > self.eager_limit && n as u64 <= self.max_message => {
                match self.bulk.get(MAX_HEADER_LEN + crate::MAX_METADATA_LEN + n) {
                    Ok(mut b) => {
                        let cap = b.capacity();
                        b.set_len(cap);
                        Some(b)
                    }
                    Err(_) => None,
                }
            }
            _ => None,
        };
        Ok(Submission {
            method: method.id,
            kind: method.kind,
            timeout_ns: timeout.map(|t| t.as_nanos().min(u128::from(u64::MAX)) as u64),
            staged,
            large: (bulk.is_some() || gathered.is_some() || landing.is_some()).then(|| {
                Box::new(Large {
                    bulk,
                    gathered,
                    landing,
                })
            }),
            inbox: None,
        })
    }

    /// Encodes `msg` (`len` bytes) with its large `bytes` field referenced where it lies in
    /// `user`'s region and the rest staged in a small bulk buffer. `None` when nothing was
    /// referenced (the caller copies as usual).
    pub(super) fn encode_gathered(
        &self,
        msg: &dyn EncodeMsg,
        len: usize,
        user: RegHandle,
    ) -> Result<Option<Staging<P>>, Status> {
        let region = user.0.as_slice();
        let mut want = len.min(STAGE_FIRST);
        for _ in 0..2 {
            let mut buf = self
                .bulk
                .get(want)
                .map_err(|e| Status::resource_exhausted(format!("bulk buffer: {e}")))?;
            let mut g = Gather::new(buf.as_mut_slice(), region, ZERO_COPY_REQUEST_MIN);
            if msg.encode_gather(&mut g).is_none() {
                // The small fields need more room than the first try: once more with what
                // they need.
                want = g.needed();
                continue;
            }
            if g.referenced() == 0 || g.len() != len {
                return Ok(None);
            }
            let (n, referenced) = (g.pieces().len(), g.referenced() as u64);
            let mut pieces = [Piece::Staged { offset: 0, len: 0 }; MAX_PIECES];
            pieces[..n].copy_from_slice(g.pieces());
            let gathered = Gathered {
                user,
                pieces,
                n,
                referenced,
                window: None,
            };
            return Ok(Some((buf, gathered)));
        }
        Ok(None)
    }

    pub(super) fn stage(
        &self,
        slot: SlotLoan<'_, P>,
        metadata: &Metadata,
        msg: &dyn EncodeMsg,
    ) -> Result<Staged, Status> {
        // SAFETY: we took the slot (the loan owns it) and have not posted it.
        let buf = unsafe { self.arena.send_buf(slot.slot) };
        let md_len = metadata.encoded_len();
        let Some(body) = buf.get_mut(MAX_HEADER_LEN..) else {
            return Err(Status::internal("slot smaller than a header"));
        };
        let Some(md_buf) = body.get_mut(..md_len) else {
            return Err(Status::resource_exhausted("metadata larger than a slot"));
        };
        metadata.encode(md_buf);
        let Some(n) = body.get_mut(md_len..).and_then(|b| msg.encode_into(b)) else {
            return Err(Status::resource_exhausted("request larger than a slot"));
        };
        Ok(Staged {
            slot: slot.into_slot(),
            md_len,
            payload_len: n,
        })
    }
}

impl<P: Provider> Driver<P> {
    /// Lends what a large request gives the server, each with the least right and for this
    /// connection only: its rendezvous payload (remote READ) and the referenced span of the
    /// user's region (remote READ), whose ranges go to `ranges` (how many is the first value),
    /// and its landing zone (remote WRITE), whose descriptor is the second.
    pub(super) fn lend(
        &self,
        l: &mut Large<P>,
        ranges: &mut [BulkDesc; MAX_PIECES],
    ) -> Result<(usize, Option<BulkDesc>), Status> {
        let qp = &self.link.qp;
        let refused = |e: crate::verbs::VerbsError| {
            Status::resource_exhausted(format!("cannot lend a bulk buffer to the server: {e}"))
        };
        let bulk = match l.bulk.as_mut() {
            Some(b) => Some(b.lend(Access::REMOTE_READ, qp).map_err(refused)?),
            None => None,
        };
        let n = match (l.gathered.as_mut(), bulk) {
            (Some(g), Some(stage)) => {
                let region = |p: &Piece| match *p {
                    Piece::Region { offset, len } => Some((offset, offset + len)),
                    Piece::Staged { .. } => None,
                };
                let span = g.pieces[..g.n]
                    .iter()
                    .filter_map(region)
                    .reduce(|a, b| (a.0.min(b.0), a.1.max(b.1)));
                let user = match span {
                    Some((start, end)) => {
                        let b = g.user.0.as_any().downcast_ref::<BulkBuf<P>>();
                        let b = b.ok_or_else(|| {
                            Status::internal("registered bytes of another provider")
                        })?;
                        let w = b
                            .window(start, end - start, Access::REMOTE_READ, qp)
                            .map_err(refused)?;
                        let r = (w.addr() - start as u64, w.rkey());
                        g.window = Some(w);
                        r
                    }
                    None => (0, 0),
                };
                for (r, p) in ranges.iter_mut().zip(&g.pieces[..g.n]) {
                    *r = match *p {
                        Piece::Staged { offset, len } => BulkDesc {
                            addr: stage.addr + offset as u64,
                            len: len as u64,
                            rkey: stage.rkey,
                        },
                        Piece::Region { offset, len } => BulkDesc {
                            addr: user.0 + offset as u64,
                            len: len as u64,
                            rkey: user.1,
                        },
                    };
                }
                g.n
            }
            (_, Some(stage)) => {
                ranges[0] = desc(stage);
                1
            }
            (_, None) => 0,
        };
        let landing = match l.landing.as_mut() {
            Some(b) => Some(desc(b.lend(Access::REMOTE_WRITE, qp).map_err(refused)?)),
            None => None,
        };
        Ok((n, landing))
    }
}
