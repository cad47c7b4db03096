//! Service IR and emitter; `.proto` front end (issue 4).
