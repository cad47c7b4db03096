//! Encoding a request: eager into a send slot, or by rendezvous from a bulk buffer (with a
//! large `bytes` field referenced where it lies in the user's registered region, or copied
//! into the buffer while the server READs it), and lending those buffers to the server when
//! the request goes out.
//!
//! A large field in ordinary memory has to be copied into registered memory once. Copied
//! whole before the request goes out, the copy and the server's READ of it take turns; sent
//! *pending* ([`crate::wire::FrameFlags::BULK_PENDING`]), the request goes out first and the
//! caller copies the field a part at a time ([`FillJob`]), telling the server after each part
//! that it may READ it (BulkReady frames, sent by the driver): the server READs part `k`
//! while the caller copies part `k + 1`.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use crate::buf::{BulkBuf, EncodeMsg, Gather, NoMsg, Piece, encode::MAX_PIECES};
use crate::call::desc;
use crate::client::RegHandle;
use crate::link::Staged;
use crate::method::{CallKind, MethodDesc};
use crate::verbs::{Access, Mr, Provider};
use crate::wire::{BulkDesc, MAX_BULK_PIECES, MAX_HEADER_LEN};
use crate::{Metadata, Status};

use super::overlap::Timed;
use super::submit::SlotLoan;
use super::{ClientCore, Driver, Gathered, Large, Pending, Staging, Submission};

/// A request's `bytes` field at least this large that lies in the registered region the
/// request names is sent from there (the server READs it) instead of being copied.
const ZERO_COPY_REQUEST_MIN: usize = 16 << 10;

/// The staging buffer first tried for the copied part of such a request (the smallest bulk
/// buffer); a larger one is taken when the small fields need more.
const STAGE_FIRST: usize = 4 << 10;

/// A request at least this large whose large `bytes` field lies in ordinary memory is sent
/// pending (see the module docs), by default ([`crate::ChannelBuilder::pending_request_min`]).
/// On the development VM (two vCPUs) the overlap paid from 8 MiB on on both of its hosts;
/// from 1 to 4 MiB it paid on one and cost on the other, so between [`super::overlap::AUTO_MIN`]
/// and this the connection measures both ways ([`super::overlap`]).
pub(crate) const PENDING_MIN: usize = 8 << 20;

/// Never smaller than this (the field must be worth a part of its own).
pub(super) const PENDING_FLOOR: usize = 64 << 10;

/// A pending payload is copied in parts of about a sixteenth of it, at least this large (but
/// at most a quarter of it): each part costs a BulkReady frame and a READ. Parts of 1 MiB
/// measured best at 8 and 16 MiB on the development VM (256 KiB parts were slower than one
/// whole copy at 1 and 4 MiB). On a connection of several QPs, parts are at least
/// [`crate::link::STRIPE_MIN`], from which a READ is striped over them.
pub(super) const FILL_PART_MIN: usize = 1 << 20;

const _: () = assert!(MAX_PIECES <= MAX_BULK_PIECES);

/// How much of a pending payload is written, from its start: stored by the caller that
/// copies it, read by the driver that tells the server.
#[derive(Debug)]
pub(crate) struct Fill {
    ready: AtomicU64,
    len: u64,
}

impl Fill {
    /// Bytes written so far.
    pub(super) fn ready(&self) -> u64 {
        self.ready.load(Ordering::Acquire)
    }

    /// The payload's length.
    pub(super) fn len(&self) -> u64 {
        self.len
    }
}

/// The copy of a pending request's large field into its registered region, done by the
/// caller in [`ClientCore::hand_over`], right after the submission went to the driver and
/// while the caller still borrows the message the field lies in.
pub(crate) struct FillJob {
    fill: Arc<Fill>,
    /// Keeps the destination alive until the copy is over, whatever became of the call
    /// meanwhile (an early answer, a dead connection).
    _region: RegHandle,
    src: *const u8,
    dst: *mut u8,
    /// Where the field starts in the payload (what is before it is written already).
    at: usize,
    len: usize,
}

// SAFETY: a `FillJob` is made by `prepare` inside a submission (its `Large`) and taken out
// of it by `hand_over` on the same thread before the submission goes to the driver; it is
// run there, while the caller still borrows the message `src` points into. It never reaches
// another thread with its pointers in use; the `Send` is for the submission that carries it.
unsafe impl Send for FillJob {}

impl FillJob {
    /// Copies the field a part at a time (a sixteenth, at least `part_min` bytes, but at most
    /// a quarter: a field sent pending is always copied in several parts), publishing after
    /// each part how much of the payload is written; `after_part` lets the driver tell the
    /// server.
    pub(super) fn run(self, part_min: usize, mut after_part: impl FnMut()) {
        let part = (self.len / 16).max(part_min.min(self.len / 4)).max(1);
        let mut done = 0;
        while done < self.len {
            // A short remainder joins the last part (no BulkReady and READ of a few bytes).
            let left = self.len - done;
            let n = if left < part + part / 2 { left } else { part };
            // SAFETY: `src..src + len` lies in the message the caller borrows (see `Send`
            // above); `dst..dst + len` lies in the region `_region` keeps alive, which no
            // one else writes (the server only READs what `fill` says is written).
            unsafe { crate::memcopy::copy_raw(self.src.add(done), self.dst.add(done), n) };
            done += n;
            // What follows the field (a few staged bytes) was written with the head.
            let ready = if done == self.len {
                self.fill.len
            } else {
                (self.at + done) as u64
            };
            self.fill.ready.store(ready, Ordering::Release);
            after_part();
        }
    }
}

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
        // A mid-sized unary request: which way it goes is this connection's choice, timed
        // until its response (a stream's end would time the stream).
        let chooser = self.overlap.as_ref().filter(|_| {
            !eager
                && method.kind == CallKind::Unary
                && (super::overlap::AUTO_MIN..self.pending_min).contains(&len)
        });
        let started = chooser.map(|_| Instant::now());
        let mut bulk = None;
        let mut gathered = None;
        let mut pending = None;
        let mut fill = None;
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
                None if (len >= self.pending_min || chooser.is_some_and(|c| c.choose()))
                    && let Some((p, job)) = self.encode_pending(msg, len)? =>
                {
                    pending = Some(p);
                    fill = Some(job);
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
        // Only what the choice was about: a copy or a pending payload, not a referenced field.
        let timed = started.filter(|_| gathered.is_none()).map(|started| Timed {
            started,
            pending: pending.is_some(),
            len,
        });
        // An `if`, not `bool::then`: the closure would take every option by value (a
        // memcpy per call) before knowing it is needed.
        let large =
            if bulk.is_some() || gathered.is_some() || pending.is_some() || landing.is_some() {
                Some(Box::new(Large {
                    bulk,
                    gathered,
                    pending,
                    fill,
                    landing,
                    timed,
                }))
            } else {
                None
            };
        Ok(Submission {
            method: method.id,
            kind: method.kind,
            timeout_ns: timeout.map(|t| t.as_nanos().min(u128::from(u64::MAX)) as u64),
            staged,
            large,
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

    /// Encodes `msg` (`len` bytes) into a new region to be sent pending: everything but its
    /// large `bytes` field now, the field by the returned job. `None` when the message has no
    /// such field (or more small bytes than a page): the caller copies it whole.
    fn encode_pending(
        &self,
        msg: &dyn EncodeMsg,
        len: usize,
    ) -> Result<Option<(Pending<P>, FillJob)>, Status> {
        let mut stage = [0u8; STAGE_FIRST];
        // The field must be most of the request.
        let mut g = Gather::anywhere(&mut stage, len / 2);
        if msg.encode_gather(&mut g).is_none() || g.len() != len || g.referenced() == 0 {
            return Ok(None);
        }
        let (pieces, n) = {
            let mut p = [Piece::Staged { offset: 0, len: 0 }; MAX_PIECES];
            p[..g.pieces().len()].copy_from_slice(g.pieces());
            (p, g.pieces().len())
        };
        let mut region = self
            .bulk
            .get(len)
            .map_err(|e| Status::resource_exhausted(format!("bulk buffer: {e}")))?;
        let dst = region.as_mut_slice();
        let mut at = 0;
        let mut field = None;
        for p in &pieces[..n] {
            match *p {
                Piece::Staged { offset, len } => {
                    crate::memcopy::copy(&mut dst[at..at + len], &stage[offset..offset + len]);
                    at += len;
                }
                // At most one (see `MAX_PIECES`): its offset is its address.
                Piece::Region { offset, len } => {
                    field = Some((offset as *const u8, at, len));
                    at += len;
                }
            }
        }
        let Some((src, at, field_len)) = field else {
            return Ok(None);
        };
        let dst = dst[at..].as_mut_ptr();
        let region = RegHandle(Arc::new(region));
        // Nothing is announced before the first part (the head alone is not worth a READ).
        let fill = Arc::new(Fill {
            ready: AtomicU64::new(0),
            len: len as u64,
        });
        let job = FillJob {
            fill: Arc::clone(&fill),
            _region: region.clone(),
            src,
            dst,
            at,
            len: field_len,
        };
        let pending = Pending {
            window: None,
            region,
            fill,
        };
        Ok(Some((pending, job)))
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
            _ if let Some(p) = l.pending.as_mut() => {
                let b = p.region.0.as_any().downcast_ref::<BulkBuf<P>>();
                let b =
                    b.ok_or_else(|| Status::internal("registered bytes of another provider"))?;
                let len = p.fill.len();
                let w = b
                    .window(0, len as usize, Access::REMOTE_READ, qp)
                    .map_err(refused)?;
                ranges[0] = BulkDesc {
                    addr: w.addr(),
                    len,
                    rkey: w.rkey(),
                };
                p.window = Some(w);
                1
            }
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
