//! The bootstrap handshake over TCP (issue 3).
