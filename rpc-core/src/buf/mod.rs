//! Registered arenas, slot rings, the bulk pool and receive-slot guards (issue 3).
