//! The sans-IO protocol core (issue 3): frame codec, calls, credits, rendezvous, deadlines.
//! No I/O and no clock: inputs come in with `now`, outputs are polled.
