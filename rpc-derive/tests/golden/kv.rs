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
        non_camel_case_types,
        non_snake_case,
        clippy::all
    )]
    /// A key-value store.
    #[derive(::core::fmt::Debug, ::core::clone::Clone)]
    pub struct KvClient {
        inner: ::rpc_core::codegen::Channel,
    }
    impl KvClient {
        /// A client over `inner` (channels are cheap to clone and share).
        pub fn new(inner: ::rpc_core::codegen::Channel) -> Self {
            Self { inner }
        }
        /// A client whose calls pass `f` before they are sent (tonic's
        /// `with_interceptor`): see `Channel::with_interceptor`.
        pub fn with_interceptor<F: ::rpc_core::codegen::Interceptor>(
            inner: ::rpc_core::codegen::Channel,
            f: F,
        ) -> Self {
            Self {
                inner: inner.with_interceptor(f),
            }
        }
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
        ) -> ::core::result::Result<Self, ::rpc_core::codegen::TransportError> {
            let inner = ::rpc_core::codegen::Channel::connect(addr).await?;
            ::core::result::Result::Ok(Self { inner })
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
            request: impl ::rpc_core::codegen::IntoRequest<super::GetRequest>,
        ) -> ::core::result::Result<
            ::rpc_core::codegen::Response<super::GetReply>,
            ::rpc_core::codegen::Status,
        >
        where
            super::GetRequest: ::rpc_core::codegen::RpcMessage,
            super::GetReply: ::rpc_core::codegen::RpcMessage,
        {
            const METHOD: ::rpc_core::codegen::MethodDesc = ::rpc_core::codegen::MethodDesc::new(
                    "/kv.Kv/Get",
                    ::rpc_core::codegen::CallKind::Unary,
                )
                .with_idempotency(::rpc_core::codegen::Idempotency::NoSideEffects);
            self.inner
                .unary(
                    &METHOD,
                    <_ as ::rpc_core::codegen::IntoRequest<
                        super::GetRequest,
                    >>::into_request(request),
                )
                .await
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
            request: impl ::rpc_core::codegen::IntoStreamingRequest<
                Message = super::PutRequest,
            >,
        ) -> ::core::result::Result<
            ::rpc_core::codegen::Response<()>,
            ::rpc_core::codegen::Status,
        >
        where
            super::PutRequest: ::rpc_core::codegen::RpcMessage,
            (): ::rpc_core::codegen::RpcMessage,
        {
            const METHOD: ::rpc_core::codegen::MethodDesc = ::rpc_core::codegen::MethodDesc::new(
                "/kv.Kv/PutMany",
                ::rpc_core::codegen::CallKind::ClientStreaming,
            );
            self.inner
                .client_streaming(
                    &METHOD,
                    ::rpc_core::codegen::IntoStreamingRequest::into_streaming_request(
                        request,
                    ),
                )
                .await
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
            request: impl ::rpc_core::codegen::IntoRequest<super::GetRequest>,
        ) -> ::core::result::Result<
            ::rpc_core::codegen::Response<::rpc_core::codegen::Streaming<super::Change>>,
            ::rpc_core::codegen::Status,
        >
        where
            super::GetRequest: ::rpc_core::codegen::RpcMessage,
            super::Change: ::rpc_core::codegen::RpcMessage,
        {
            const METHOD: ::rpc_core::codegen::MethodDesc = ::rpc_core::codegen::MethodDesc::new(
                "/kv.Kv/Watch",
                ::rpc_core::codegen::CallKind::ServerStreaming,
            );
            self.inner
                .server_streaming(
                    &METHOD,
                    <_ as ::rpc_core::codegen::IntoRequest<
                        super::GetRequest,
                    >>::into_request(request),
                )
                .await
        }
    }
    impl ::core::convert::From<::rpc_core::codegen::Channel> for KvClient {
        fn from(inner: ::rpc_core::codegen::Channel) -> Self {
            Self { inner }
        }
    }
    impl ::core::convert::AsRef<::rpc_core::codegen::Channel> for KvClient {
        fn as_ref(&self) -> &::rpc_core::codegen::Channel {
            &self.inner
        }
    }
    /// Blocking calls of `kv.Kv` for the lowest latency: the calling thread polls the completion queue itself. The unary methods of [`KvClient`], under the same names; build it with `From` from a [`KvClient`] or a channel.
    #[derive(::core::fmt::Debug, ::core::clone::Clone)]
    pub struct KvBlockingClient {
        inner: ::rpc_core::codegen::Channel,
    }
    impl KvBlockingClient {
        /// A blocking client over `inner` (channels are cheap to clone and share).
        pub fn new(inner: ::rpc_core::codegen::Channel) -> Self {
            Self { inner }
        }
        /// A client whose calls pass `f` before they are sent (tonic's
        /// `with_interceptor`): see `Channel::with_interceptor`.
        pub fn with_interceptor<F: ::rpc_core::codegen::Interceptor>(
            inner: ::rpc_core::codegen::Channel,
            f: F,
        ) -> Self {
            Self {
                inner: inner.with_interceptor(f),
            }
        }
        /// Blocking variant of [`KvClient::get`]: the calling thread polls the completion queue itself.
        ///
        /// # Errors
        /// The call's status: the handler's error, or the runtime's when the call could not be
        /// completed.
        pub fn get(
            &self,
            request: impl ::rpc_core::codegen::IntoRequest<super::GetRequest>,
        ) -> ::core::result::Result<
            ::rpc_core::codegen::Response<super::GetReply>,
            ::rpc_core::codegen::Status,
        >
        where
            super::GetRequest: ::rpc_core::codegen::RpcMessage,
            super::GetReply: ::rpc_core::codegen::RpcMessage,
        {
            const METHOD: ::rpc_core::codegen::MethodDesc = ::rpc_core::codegen::MethodDesc::new(
                    "/kv.Kv/Get",
                    ::rpc_core::codegen::CallKind::Unary,
                )
                .with_idempotency(::rpc_core::codegen::Idempotency::NoSideEffects);
            self.inner
                .unary_blocking(
                    &METHOD,
                    <_ as ::rpc_core::codegen::IntoRequest<
                        super::GetRequest,
                    >>::into_request(request),
                )
        }
    }
    impl ::core::convert::From<::rpc_core::codegen::Channel> for KvBlockingClient {
        fn from(inner: ::rpc_core::codegen::Channel) -> Self {
            Self { inner }
        }
    }
    impl ::core::convert::AsRef<::rpc_core::codegen::Channel> for KvBlockingClient {
        fn as_ref(&self) -> &::rpc_core::codegen::Channel {
            &self.inner
        }
    }
    impl ::core::convert::From<KvClient> for KvBlockingClient {
        fn from(client: KvClient) -> Self {
            Self { inner: client.inner }
        }
    }
    /// Pipelines of `kv.Kv`: one method per unary method of [`KvClient`], under the same name, opening a pipeline of that method (many calls in flight from one thread without async tasks: submit with a tag, collect responses with `poll`/`wait`). Build it with `From` from a [`KvClient`] or a channel.
    #[derive(::core::fmt::Debug, ::core::clone::Clone)]
    pub struct KvPipelineClient {
        inner: ::rpc_core::codegen::Channel,
    }
    impl KvPipelineClient {
        /// A pipeline client over `inner` (channels are cheap to clone and share).
        pub fn new(inner: ::rpc_core::codegen::Channel) -> Self {
            Self { inner }
        }
        /// A client whose calls pass `f` before they are sent (tonic's
        /// `with_interceptor`): see `Channel::with_interceptor`.
        pub fn with_interceptor<F: ::rpc_core::codegen::Interceptor>(
            inner: ::rpc_core::codegen::Channel,
            f: F,
        ) -> Self {
            Self {
                inner: inner.with_interceptor(f),
            }
        }
        /// A pipeline of [`KvClient::get`]: many calls in flight from one thread without async tasks (see `Channel::pipeline`).
        ///
        /// # Errors
        /// `UNAVAILABLE` when there is no connection and reconnecting fails.
        pub fn get(
            &self,
        ) -> ::core::result::Result<
            ::rpc_core::codegen::Pipeline<super::GetRequest, super::GetReply>,
            ::rpc_core::codegen::Status,
        >
        where
            super::GetRequest: ::rpc_core::codegen::RpcMessage,
            super::GetReply: ::rpc_core::codegen::RpcMessage,
        {
            const METHOD: ::rpc_core::codegen::MethodDesc = ::rpc_core::codegen::MethodDesc::new(
                    "/kv.Kv/Get",
                    ::rpc_core::codegen::CallKind::Unary,
                )
                .with_idempotency(::rpc_core::codegen::Idempotency::NoSideEffects);
            self.inner.pipeline(&METHOD)
        }
    }
    impl ::core::convert::From<::rpc_core::codegen::Channel> for KvPipelineClient {
        fn from(inner: ::rpc_core::codegen::Channel) -> Self {
            Self { inner }
        }
    }
    impl ::core::convert::AsRef<::rpc_core::codegen::Channel> for KvPipelineClient {
        fn as_ref(&self) -> &::rpc_core::codegen::Channel {
            &self.inner
        }
    }
    impl ::core::convert::From<KvClient> for KvPipelineClient {
        fn from(client: KvClient) -> Self {
            Self { inner: client.inner }
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
        non_camel_case_types,
        non_snake_case,
        clippy::all
    )]
    /// `/kv.Kv/Get`.
    pub const GET: ::rpc_core::codegen::MethodDesc = ::rpc_core::codegen::MethodDesc::new(
            "/kv.Kv/Get",
            ::rpc_core::codegen::CallKind::Unary,
        )
        .with_idempotency(::rpc_core::codegen::Idempotency::NoSideEffects);
    /// `/kv.Kv/PutMany`.
    pub const PUT_MANY: ::rpc_core::codegen::MethodDesc = ::rpc_core::codegen::MethodDesc::new(
        "/kv.Kv/PutMany",
        ::rpc_core::codegen::CallKind::ClientStreaming,
    );
    /// `/kv.Kv/Watch`.
    pub const WATCH: ::rpc_core::codegen::MethodDesc = ::rpc_core::codegen::MethodDesc::new(
        "/kv.Kv/Watch",
        ::rpc_core::codegen::CallKind::ServerStreaming,
    );
    /// A key-value store.
    pub trait Kv: ::core::marker::Send + ::core::marker::Sync + 'static {
        /// Reads a key.
        fn get(
            &self,
            request: ::rpc_core::codegen::Request<super::GetRequest>,
        ) -> impl ::rpc_core::codegen::Future<
            Output = ::core::result::Result<
                ::rpc_core::codegen::Response<super::GetReply>,
                ::rpc_core::codegen::Status,
            >,
        > + ::core::marker::Send;
        /// Stores many keys.
        fn put_many(
            &self,
            request: ::rpc_core::codegen::Request<
                ::rpc_core::codegen::Streaming<super::PutRequest>,
            >,
        ) -> impl ::rpc_core::codegen::Future<
            Output = ::core::result::Result<
                ::rpc_core::codegen::Response<()>,
                ::rpc_core::codegen::Status,
            >,
        > + ::core::marker::Send;
        /// The stream of responses of [`Kv::watch`].
        type WatchStream: ::rpc_core::codegen::Stream<
                Item = ::core::result::Result<super::Change, ::rpc_core::codegen::Status>,
            >
            + ::core::marker::Send
            + 'static;
        /// Watches keys.
        fn watch(
            &self,
            request: ::rpc_core::codegen::Request<super::GetRequest>,
        ) -> impl ::rpc_core::codegen::Future<
            Output = ::core::result::Result<
                ::rpc_core::codegen::Response<Self::WatchStream>,
                ::rpc_core::codegen::Status,
            >,
        > + ::core::marker::Send;
    }
    /// Serves a [`Kv`] implementation as `kv.Kv`: hand it to the server builder's `add_service`.
    pub struct KvServer<T> {
        inner: ::rpc_core::codegen::Arc<T>,
    }
    impl<T> KvServer<T> {
        /// Every method of `kv.Kv`, in declaration order (also `Service::methods`).
        pub const METHODS: &'static [::rpc_core::codegen::MethodDesc] = &[
            GET,
            PUT_MANY,
            WATCH,
        ];
    }
    impl<T: Kv> KvServer<T> {
        /// Serves `inner`.
        pub fn new(inner: T) -> Self {
            Self::from_arc(::rpc_core::codegen::Arc::new(inner))
        }
        /// Serves a shared `inner`.
        pub fn from_arc(inner: ::rpc_core::codegen::Arc<T>) -> Self {
            Self { inner }
        }
        /// Serves `inner` with `f` run on every call's request metadata before its
        /// handler (tonic's `with_interceptor`); a status from `f` ends the call.
        pub fn with_interceptor<F: ::rpc_core::codegen::Interceptor>(
            inner: T,
            f: F,
        ) -> ::rpc_core::codegen::InterceptedService<Self, F> {
            ::rpc_core::codegen::InterceptedService::new(Self::new(inner), f)
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
    impl<T: Kv> ::rpc_core::codegen::Service for KvServer<T>
    where
        super::GetRequest: ::rpc_core::codegen::RpcMessage,
        super::GetReply: ::rpc_core::codegen::RpcMessage,
        super::PutRequest: ::rpc_core::codegen::RpcMessage,
        (): ::rpc_core::codegen::RpcMessage,
        super::GetRequest: ::rpc_core::codegen::RpcMessage,
        super::Change: ::rpc_core::codegen::RpcMessage,
    {
        fn name(&self) -> &'static str {
            "kv.Kv"
        }
        fn methods(&self) -> &'static [::rpc_core::codegen::MethodDesc] {
            Self::METHODS
        }
        fn call(
            &self,
            method: u32,
            call: ::rpc_core::codegen::IncomingCall<'_>,
        ) -> ::rpc_core::codegen::Dispatched {
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
    /// Every [`Kv`](super::Kv) serves as [`Kv`]: requests and replies are unwrapped and wrapped.
    #[allow(deprecated)]
    impl<T: super::Kv> Kv for T {
        fn get(
            &self,
            request: ::rpc_core::codegen::Request<super::GetRequest>,
        ) -> impl ::core::future::Future<
            Output = ::core::result::Result<
                ::rpc_core::codegen::Response<super::GetReply>,
                ::rpc_core::codegen::Status,
            >,
        > + ::core::marker::Send {
            let reply = <T as super::Kv>::get(
                self,
                ::rpc_core::codegen::Request::into_inner(request),
            );
            async move {
                ::core::result::Result::map(
                    reply.await,
                    ::rpc_core::codegen::Response::new,
                )
            }
        }
        fn put_many(
            &self,
            request: ::rpc_core::codegen::Request<
                ::rpc_core::codegen::Streaming<super::PutRequest>,
            >,
        ) -> impl ::core::future::Future<
            Output = ::core::result::Result<
                ::rpc_core::codegen::Response<()>,
                ::rpc_core::codegen::Status,
            >,
        > + ::core::marker::Send {
            let reply = <T as super::Kv>::put_many(
                self,
                ::rpc_core::codegen::Request::into_inner(request),
            );
            async move {
                ::core::result::Result::map(
                    reply.await,
                    ::rpc_core::codegen::Response::new,
                )
            }
        }
        type WatchStream = <T as super::Kv>::Changes;
        fn watch(
            &self,
            request: ::rpc_core::codegen::Request<super::GetRequest>,
        ) -> impl ::core::future::Future<
            Output = ::core::result::Result<
                ::rpc_core::codegen::Response<Self::WatchStream>,
                ::rpc_core::codegen::Status,
            >,
        > + ::core::marker::Send {
            let reply = <T as super::Kv>::watch(
                self,
                ::rpc_core::codegen::Request::into_inner(request),
            );
            async move {
                ::core::result::Result::map(
                    reply.await,
                    ::rpc_core::codegen::Response::new,
                )
            }
        }
    }
}
