/// Generated client implementations.
pub(crate) mod kv_client {
    #![allow(
        unused_variables,
        unused_imports,
        dead_code,
        missing_docs,
        private_interfaces,
        private_bounds,
        clippy::all
    )]
    use crate::rt::codegen::*;
    /// A store.
    #[derive(::core::fmt::Debug, ::core::clone::Clone)]
    pub struct KvClient {
        inner: Channel,
    }
    impl KvClient {
        /// Connects to the server at `addr` (`host:port`) and returns a client of `store.v1.Kv`.
        ///
        /// # Errors
        /// When the address does not resolve, the connection fails or the handshake is
        /// refused.
        ///
        /// # Cancel safety
        /// Dropping the future abandons the attempt and frees what it set up.
        pub async fn connect(
            addr: impl ::core::convert::AsRef<str>,
        ) -> ::core::result::Result<Self, TransportError> {
            let inner = Channel::connect(addr).await?;
            ::core::result::Result::Ok(Self::new(inner))
        }
        /// A client over an existing channel (channels are cheap to clone and share).
        pub fn new(inner: Channel) -> Self {
            Self { inner }
        }
        /// The channel this client calls through.
        pub fn channel(&self) -> &Channel {
            &self.inner
        }
        /// Reads a key.
        ///
        /// # Errors
        /// The call's status: the handler's error, or the runtime's when the call could not be
        /// completed.
        ///
        /// # Cancel safety
        /// Dropping the future cancels the call: the server is told, and buffers return to
        /// their pools only after the NIC is done with them.
        pub async fn get(
            &self,
            request: impl IntoRequest<crate::msgs::GetRequest>,
        ) -> ::core::result::Result<Response<super::GetReply>, Status> {
            const METHOD: MethodDesc = MethodDesc::new(
                "/store.v1.Kv/Get",
                CallKind::Unary,
            );
            self.inner.unary(&METHOD, request.into_request()).await
        }
        /// Blocking variant of [`Self::get`] for the lowest latency: the calling thread polls the completion queue itself.
        ///
        /// # Errors
        /// The call's status: the handler's error, or the runtime's when the call could not be
        /// completed.
        pub fn get_blocking(
            &self,
            request: impl IntoRequest<crate::msgs::GetRequest>,
        ) -> ::core::result::Result<Response<super::GetReply>, Status> {
            const METHOD: MethodDesc = MethodDesc::new(
                "/store.v1.Kv/Get",
                CallKind::Unary,
            );
            self.inner.unary_blocking(&METHOD, request.into_request())
        }
        /// Many [`Self::get`] calls in flight from one thread without async tasks: submit with a tag, collect responses with `poll`/`wait` (see `Channel::pipeline`).
        ///
        /// # Errors
        /// `UNAVAILABLE` when there is no connection and reconnecting fails.
        pub fn get_pipeline(
            &self,
        ) -> ::core::result::Result<
            Pipeline<crate::msgs::GetRequest, super::GetReply>,
            Status,
        > {
            const METHOD: MethodDesc = MethodDesc::new(
                "/store.v1.Kv/Get",
                CallKind::Unary,
            );
            self.inner.pipeline(&METHOD)
        }
        /// Calls `/store.v1.Kv/Watch`.
        ///
        /// # Errors
        /// The call's status: the handler's error, or the runtime's when the call could not be
        /// completed.
        ///
        /// # Cancel safety
        /// Dropping the future cancels the call: the server is told, and buffers return to
        /// their pools only after the NIC is done with them.
        #[deprecated]
        pub async fn watch(
            &self,
            request: impl IntoStreamingRequest<Message = super::super::WatchRequest>,
        ) -> ::core::result::Result<Response<Streaming<::events::Event>>, Status> {
            const METHOD: MethodDesc = MethodDesc::new(
                "/store.v1.Kv/Watch",
                CallKind::Streaming,
            );
            self.inner.streaming(&METHOD, request.into_streaming_request()).await
        }
    }
}
/// Generated server implementations.
pub(crate) mod kv_server {
    #![allow(
        unused_variables,
        unused_imports,
        dead_code,
        missing_docs,
        private_interfaces,
        private_bounds,
        clippy::all
    )]
    use crate::rt::codegen::*;
    /// `/store.v1.Kv/Get`.
    pub const GET: MethodDesc = MethodDesc::new("/store.v1.Kv/Get", CallKind::Unary);
    /// `/store.v1.Kv/Watch`.
    pub const WATCH: MethodDesc = MethodDesc::new(
        "/store.v1.Kv/Watch",
        CallKind::Streaming,
    );
    /// Every method of `store.v1.Kv`, in declaration order.
    pub const METHODS: &[MethodDesc] = &[GET, WATCH];
    /// A store.
    pub trait Kv: ::core::marker::Send + ::core::marker::Sync + 'static {
        /// Reads a key.
        fn get(
            &self,
            request: Request<crate::msgs::GetRequest>,
        ) -> impl Future<
            Output = ::core::result::Result<Response<super::GetReply>, Status>,
        > + ::core::marker::Send;
        /// The stream of responses of [`Kv::watch`].
        type WatchStream: Stream<Item = ::core::result::Result<::events::Event, Status>>
            + ::core::marker::Send
            + 'static;
        /// Handles `/store.v1.Kv/Watch`.
        fn watch(
            &self,
            request: Request<Streaming<super::super::WatchRequest>>,
        ) -> impl Future<
            Output = ::core::result::Result<Response<Self::WatchStream>, Status>,
        > + ::core::marker::Send;
    }
    /// Serves a [`Kv`] implementation as `store.v1.Kv`: hand it to the server builder's `add_service`.
    pub struct KvServer<T> {
        inner: Arc<T>,
    }
    impl<T: Kv> KvServer<T> {
        /// Serves `inner`.
        pub fn new(inner: T) -> Self {
            Self::from_arc(Arc::new(inner))
        }
        /// Serves a shared `inner`.
        pub fn from_arc(inner: Arc<T>) -> Self {
            Self { inner }
        }
    }
    impl<T> ::core::clone::Clone for KvServer<T> {
        fn clone(&self) -> Self {
            Self {
                inner: ::core::clone::Clone::clone(&self.inner),
            }
        }
    }
    impl<T> ::core::fmt::Debug for KvServer<T> {
        fn fmt(&self, f: &mut ::core::fmt::Formatter<'_>) -> ::core::fmt::Result {
            f.debug_struct(::core::stringify!(KvServer)).finish_non_exhaustive()
        }
    }
    impl<T: Kv> Service for KvServer<T> {
        fn name(&self) -> &'static str {
            "store.v1.Kv"
        }
        fn methods(&self) -> &'static [MethodDesc] {
            METHODS
        }
        fn call(&self, method: u32, call: IncomingCall<'_>) -> Dispatched {
            match method {
                id if id == GET.id => {
                    let inner = ::core::clone::Clone::clone(&self.inner);
                    call.unary(move |request| async move {
                        <T as Kv>::get(&inner, request).await
                    })
                }
                id if id == WATCH.id => {
                    let inner = ::core::clone::Clone::clone(&self.inner);
                    call.streaming(move |request| async move {
                        <T as Kv>::watch(&inner, request).await
                    })
                }
                _ => call.unimplemented(),
            }
        }
    }
}
