//! Registered memory and preallocated storage of the data path.
//!
//! - [`slots`]: a connection's arena carved into send and receive slot rings, with receive-slot
//!   guards that repost their RECV when dropped.
//! - [`sends`]: registered send slots, in chunks, shared by the connections that send from
//!   them (a server shard's, a client process's channels on one device).
//! - `stack`: the lock-free LIFO of a pool's free send slots (the warmest slot first).
//! - [`pool`]: a server shard's receive slots, shared by its connections through one SRQ.
//! - [`bulk`]: the pool of registered buffers for rendezvous payloads and landing zones.
//! - [`decode`]: a `Buf` that decodes prost messages from registered memory, borrowing it for
//!   large `bytes` fields.
//! - [`task`]: in-place storage for handler futures and allocation-free wakers.

pub mod bulk;
pub mod decode;
pub mod encode;
pub mod handoff;
pub mod pool;
pub mod sends;
pub mod slots;
mod stack;
pub mod task;

pub use bulk::{BulkBuf, BulkPool};
pub use decode::{Lend, SlotReader};
pub use encode::{EncodeMsg, Gather, NoMsg, Piece, RawBytes};
pub use handoff::{CancelOutcome, Exclusive, Mailbox, Taken};
pub use pool::RecvPool;
pub use slots::{Geometry, RecvSlot, SlotArena};
pub use task::{CtxFamily, FutureTask, Notify, Polled, SlabTask, Spawned, TaskId, TaskSlab};
