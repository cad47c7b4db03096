/// A key-value store.
pub trait Kv: ::core::marker::Send + ::core::marker::Sync + 'static {
    /// Reads a key.
    fn get(
        &self,
        request: GetRequest,
    ) -> impl ::core::future::Future<
        Output = Result<GetReply, Status>,
    > + ::core::marker::Send;
    /// Stores many keys.
    fn put_many(
        &self,
        request: Streaming<PutRequest>,
    ) -> impl ::core::future::Future<Output = Result<(), Status>> + ::core::marker::Send;
    /// Changes.
    type Changes: Stream<Item = Result<Change, Status>> + ::core::marker::Send + 'static;
    /// Watches keys.
    fn watch(
        &self,
        request: GetRequest,
    ) -> impl ::core::future::Future<
        Output = Result<Self::Changes, Status>,
    > + ::core::marker::Send;
}
/// Generated client implementations.
pub mod kv_client {
    #![allow(
        unused_variables,
        unused_imports,
        dead_code,
        missing_docs,
        private_interfaces,
        private_bounds,
        clippy::all
    )]
    use ::rpc_core::codegen::*;
    /// A key-value store.
    #[derive(::core::fmt::Debug, ::core::clone::Clone)]
    pub struct KvClient {
        inner: Channel,
    }
    impl KvClient {
        /// Connects to the server at `addr` (`host:port`) and returns a client of `kv.Kv`.
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
            request: impl IntoRequest<super::GetRequest>,
        ) -> ::core::result::Result<Response<super::GetReply>, Status> {
            const METHOD: MethodDesc = MethodDesc::new("/kv.Kv/Get", CallKind::Unary);
            self.inner.unary(&METHOD, request.into_request()).await
        }
        /// Blocking variant of [`Self::get`] for the lowest latency: the calling thread polls the completion queue itself.
        ///
        /// # Errors
        /// The call's status: the handler's error, or the runtime's when the call could not be
        /// completed.
        pub fn get_blocking(
            &self,
            request: impl IntoRequest<super::GetRequest>,
        ) -> ::core::result::Result<Response<super::GetReply>, Status> {
            const METHOD: MethodDesc = MethodDesc::new("/kv.Kv/Get", CallKind::Unary);
            self.inner.unary_blocking(&METHOD, request.into_request())
        }
        /// Many [`Self::get`] calls in flight from one thread without async tasks: submit with a tag, collect responses with `poll`/`wait` (see `Channel::pipeline`).
        ///
        /// # Errors
        /// `UNAVAILABLE` when there is no connection and reconnecting fails.
        pub fn get_pipeline(
            &self,
        ) -> ::core::result::Result<
            Pipeline<super::GetRequest, super::GetReply>,
            Status,
        > {
            const METHOD: MethodDesc = MethodDesc::new("/kv.Kv/Get", CallKind::Unary);
            self.inner.pipeline(&METHOD)
        }
        /// Stores many keys.
        ///
        /// # Errors
        /// The call's status: the handler's error, or the runtime's when the call could not be
        /// completed.
        ///
        /// # Cancel safety
        /// Dropping the future cancels the call: the server is told, and buffers return to
        /// their pools only after the NIC is done with them.
        pub async fn put_many(
            &self,
            request: impl IntoStreamingRequest<Message = super::PutRequest>,
        ) -> ::core::result::Result<Response<()>, Status> {
            const METHOD: MethodDesc = MethodDesc::new(
                "/kv.Kv/PutMany",
                CallKind::ClientStreaming,
            );
            self.inner.client_streaming(&METHOD, request.into_streaming_request()).await
        }
        /// Watches keys.
        ///
        /// # Errors
        /// The call's status: the handler's error, or the runtime's when the call could not be
        /// completed.
        ///
        /// # Cancel safety
        /// Dropping the future cancels the call: the server is told, and buffers return to
        /// their pools only after the NIC is done with them.
        pub async fn watch(
            &self,
            request: impl IntoRequest<super::GetRequest>,
        ) -> ::core::result::Result<Response<Streaming<super::Change>>, Status> {
            const METHOD: MethodDesc = MethodDesc::new(
                "/kv.Kv/Watch",
                CallKind::ServerStreaming,
            );
            self.inner.server_streaming(&METHOD, request.into_request()).await
        }
    }
}
/// Generated server implementations.
pub mod kv_server {
    #![allow(
        unused_variables,
        unused_imports,
        dead_code,
        missing_docs,
        private_interfaces,
        private_bounds,
        clippy::all
    )]
    use ::rpc_core::codegen::*;
    /// `/kv.Kv/Get`.
    pub const GET: MethodDesc = MethodDesc::new("/kv.Kv/Get", CallKind::Unary);
    /// `/kv.Kv/PutMany`.
    pub const PUT_MANY: MethodDesc = MethodDesc::new(
        "/kv.Kv/PutMany",
        CallKind::ClientStreaming,
    );
    /// `/kv.Kv/Watch`.
    pub const WATCH: MethodDesc = MethodDesc::new(
        "/kv.Kv/Watch",
        CallKind::ServerStreaming,
    );
    /// Every method of `kv.Kv`, in declaration order.
    pub const METHODS: &[MethodDesc] = &[GET, PUT_MANY, WATCH];
    /// A key-value store.
    pub trait Kv: ::core::marker::Send + ::core::marker::Sync + 'static {
        /// Reads a key.
        fn get(
            &self,
            request: Request<super::GetRequest>,
        ) -> impl Future<
            Output = ::core::result::Result<Response<super::GetReply>, Status>,
        > + ::core::marker::Send;
        /// Stores many keys.
        fn put_many(
            &self,
            request: Request<Streaming<super::PutRequest>>,
        ) -> impl Future<
            Output = ::core::result::Result<Response<()>, Status>,
        > + ::core::marker::Send;
        /// The stream of responses of [`Kv::watch`].
        type WatchStream: Stream<Item = ::core::result::Result<super::Change, Status>>
            + ::core::marker::Send
            + 'static;
        /// Watches keys.
        fn watch(
            &self,
            request: Request<super::GetRequest>,
        ) -> impl Future<
            Output = ::core::result::Result<Response<Self::WatchStream>, Status>,
        > + ::core::marker::Send;
    }
    /// Serves a [`Kv`] implementation as `kv.Kv`: hand it to the server builder's `add_service`.
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
            "kv.Kv"
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
                id if id == PUT_MANY.id => {
                    let inner = ::core::clone::Clone::clone(&self.inner);
                    call.client_streaming(move |request| async move {
                        <T as Kv>::put_many(&inner, request).await
                    })
                }
                id if id == WATCH.id => {
                    let inner = ::core::clone::Clone::clone(&self.inner);
                    call.server_streaming(move |request| async move {
                        <T as Kv>::watch(&inner, request).await
                    })
                }
                _ => call.unimplemented(),
            }
        }
    }
}
/// Every [`Kv`] serves as [`kv_server::Kv`]: requests and replies are unwrapped and wrapped.
impl<T: Kv> kv_server::Kv for T {
    fn get(
        &self,
        request: ::rpc_core::codegen::Request<GetRequest>,
    ) -> impl ::core::future::Future<
        Output = ::core::result::Result<
            ::rpc_core::codegen::Response<GetReply>,
            ::rpc_core::codegen::Status,
        >,
    > + ::core::marker::Send {
        let reply = <T as Kv>::get(
            self,
            ::rpc_core::codegen::Request::into_inner(request),
        );
        async move {
            ::core::result::Result::map(reply.await, ::rpc_core::codegen::Response::new)
        }
    }
    fn put_many(
        &self,
        request: ::rpc_core::codegen::Request<::rpc_core::codegen::Streaming<PutRequest>>,
    ) -> impl ::core::future::Future<
        Output = ::core::result::Result<
            ::rpc_core::codegen::Response<()>,
            ::rpc_core::codegen::Status,
        >,
    > + ::core::marker::Send {
        let reply = <T as Kv>::put_many(
            self,
            ::rpc_core::codegen::Request::into_inner(request),
        );
        async move {
            ::core::result::Result::map(reply.await, ::rpc_core::codegen::Response::new)
        }
    }
    type WatchStream = <T as Kv>::Changes;
    fn watch(
        &self,
        request: ::rpc_core::codegen::Request<GetRequest>,
    ) -> impl ::core::future::Future<
        Output = ::core::result::Result<
            ::rpc_core::codegen::Response<Self::WatchStream>,
            ::rpc_core::codegen::Status,
        >,
    > + ::core::marker::Send {
        let reply = <T as Kv>::watch(
            self,
            ::rpc_core::codegen::Request::into_inner(request),
        );
        async move {
            ::core::result::Result::map(reply.await, ::rpc_core::codegen::Response::new)
        }
    }
}
