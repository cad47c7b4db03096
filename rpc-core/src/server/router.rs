//! Method id -> service lookup, built once when the server starts.

use std::sync::Arc;

use crate::method::MethodDesc;
use crate::server::Service;

/// A sorted table of every method of every service.
pub(crate) struct Router {
    services: Vec<Arc<dyn Service>>,
    /// (method id, service index, descriptor), sorted by id.
    methods: Vec<(u32, usize, &'static MethodDesc)>,
}

impl std::fmt::Debug for Router {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Router")
            .field("methods", &self.methods.len())
            .finish()
    }
}

impl Router {
    /// Builds the table.
    ///
    /// # Errors
    /// When two methods share an id (an FNV-1a collision or the same service added twice).
    pub(crate) fn new(services: Vec<Arc<dyn Service>>) -> Result<Router, String> {
        let mut methods = Vec::new();
        for (i, s) in services.iter().enumerate() {
            for m in s.methods() {
                methods.push((m.id, i, m));
            }
        }
        methods.sort_by_key(|m| m.0);
        for w in methods.windows(2) {
            if w[0].0 == w[1].0 {
                return Err(format!(
                    "methods {} and {} have the same id {:#x} (added twice, or an id collision: \
                     rename one)",
                    w[0].2.path, w[1].2.path, w[0].0
                ));
            }
        }
        Ok(Router { services, methods })
    }

    /// The service and descriptor of method `id`.
    pub(crate) fn get(&self, id: u32) -> Option<(&Arc<dyn Service>, &'static MethodDesc)> {
        let i = self.methods.binary_search_by_key(&id, |m| m.0).ok()?;
        let (_, s, d) = self.methods[i];
        Some((&self.services[s], d))
    }
}
