//! Tests of the protocol core through a fake transport and a fake clock.
