//! Several RC queue pairs per connection, striped round-robin (NCCL_IB_QPS_PER_CONNECTION):
//! on real fabrics more QPs spread one connection's traffic over more hardware queues and
//! ECMP paths. How many is [`Provider::qps_per_connection`].

use std::fmt;

use super::{ConnectAttr, Endpoint, ErrorKind, Pd, Provider, Qp, QpCaps, Result, Verb, VerbsError};

/// `n` QPs of one connection, created, connected and used together.
pub struct QpGroup<P: Provider> {
    qps: Vec<P::Qp>,
    next: usize,
}

impl<P: Provider> fmt::Debug for QpGroup<P> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("QpGroup")
            .field("provider", &P::NAME)
            .field("qps", &self.qps)
            .finish()
    }
}

impl<P: Provider> QpGroup<P> {
    /// Creates `n` QPs (in RESET) with the same CQs and sizes. Size the CQs for all of them.
    ///
    /// # Errors
    /// [`ErrorKind::InvalidArgument`] for `n == 0`; otherwise as [`Pd::create_qp`].
    pub fn create(
        pd: &P::Pd,
        send_cq: &P::Cq,
        recv_cq: &P::Cq,
        caps: QpCaps,
        n: u32,
    ) -> Result<QpGroup<P>> {
        if n == 0 {
            return Err(VerbsError::new(
                Verb::CreateQp,
                ErrorKind::InvalidArgument,
                "a QP group needs at least one QP",
            ));
        }
        let qps = (0..n)
            .map(|_| pd.create_qp(send_cq, recv_cq, caps))
            .collect::<Result<Vec<_>>>()?;
        Ok(QpGroup { qps, next: 0 })
    }

    /// The endpoints to send to the peer, in QP order.
    pub fn endpoints(&self) -> Vec<Endpoint> {
        self.qps.iter().map(Qp::endpoint).collect()
    }

    /// Connects QP `i` to the peer's QP `i`, for every `i`.
    ///
    /// # Errors
    /// [`ErrorKind::InvalidEndpoint`] when the peer has another number of QPs; otherwise as
    /// [`Qp::connect`].
    pub fn connect(&mut self, remote: &[Endpoint], attr: &ConnectAttr) -> Result<()> {
        if remote.len() != self.qps.len() {
            return Err(VerbsError::new(
                Verb::Connect,
                ErrorKind::InvalidEndpoint,
                format!(
                    "the peer has {} QPs for this connection, we have {}: both sides must use \
                     the same QPs-per-connection setting",
                    remote.len(),
                    self.qps.len()
                ),
            ));
        }
        for (qp, ep) in self.qps.iter_mut().zip(remote) {
            qp.connect(ep, attr)?;
        }
        Ok(())
    }

    /// Number of QPs.
    pub fn len(&self) -> usize {
        self.qps.len()
    }

    /// Whether the group is empty (never: creation refuses zero).
    pub fn is_empty(&self) -> bool {
        self.qps.is_empty()
    }

    /// QP `i`.
    pub fn get(&self, i: usize) -> Option<&P::Qp> {
        self.qps.get(i)
    }

    /// QP `i`, mutably (to post on it).
    pub fn get_mut(&mut self, i: usize) -> Option<&mut P::Qp> {
        self.qps.get_mut(i)
    }

    /// The next QP in round-robin order, with its index (stripe message `k` on QP `k mod n`).
    pub fn next_qp(&mut self) -> (usize, &mut P::Qp) {
        let i = self.next;
        self.next = if i + 1 >= self.qps.len() { 0 } else { i + 1 };
        (i, &mut self.qps[i])
    }

    /// Every QP, mutably.
    pub fn iter_mut(&mut self) -> std::slice::IterMut<'_, P::Qp> {
        self.qps.iter_mut()
    }

    /// Whether the QP number belongs to this group, and its index (to route a completion).
    pub fn index_of(&self, qp_num: u32) -> Option<usize> {
        self.qps.iter().position(|q| q.qp_num() == qp_num)
    }
}
