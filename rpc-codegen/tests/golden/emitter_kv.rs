/// Generated client implementations.
pub(crate) mod kv_client {
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
    /// A store.
    #[derive(::core::fmt::Debug, ::core::clone::Clone)]
    pub struct KvClient {
        inner: crate::rt::codegen::Channel,
    }
    impl KvClient {
        /// A client over `inner` (channels are cheap to clone and share).
        pub fn new(inner: crate::rt::codegen::Channel) -> Self {
            Self { inner }
        }
        /// A client whose calls pass `f` before they are sent (tonic's
        /// `with_interceptor`): see `Channel::with_interceptor`.
        pub fn with_interceptor<F: crate::rt::codegen::Interceptor>(
            inner: crate::rt::codegen::Channel,
            f: F,
        ) -> Self {
            Self {
                inner: inner.with_interceptor(f),
            }
        }
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
        ) -> ::core::result::Result<Self, crate::rt::codegen::TransportError> {
            let inner = crate::rt::codegen::Channel::connect(addr).await?;
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
            request: impl crate::rt::codegen::IntoRequest<crate::msgs::GetRequest>,
        ) -> ::core::result::Result<
            crate::rt::codegen::Response<super::GetReply>,
            crate::rt::codegen::Status,
        > {
            const METHOD: crate::rt::codegen::MethodDesc = crate::rt::codegen::MethodDesc::new(
                    "/store.v1.Kv/Get",
                    crate::rt::codegen::CallKind::Unary,
                )
                .with_idempotency(crate::rt::codegen::Idempotency::NoSideEffects);
            self.inner
                .unary(
                    &METHOD,
                    <_ as crate::rt::codegen::IntoRequest<
                        crate::msgs::GetRequest,
                    >>::into_request(request),
                )
                .await
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
            request: impl crate::rt::codegen::IntoStreamingRequest<
                Message = super::super::WatchRequest,
            >,
        ) -> ::core::result::Result<
            crate::rt::codegen::Response<crate::rt::codegen::Streaming<::events::Event>>,
            crate::rt::codegen::Status,
        > {
            const METHOD: crate::rt::codegen::MethodDesc = crate::rt::codegen::MethodDesc::new(
                "/store.v1.Kv/Watch",
                crate::rt::codegen::CallKind::Streaming,
            );
            self.inner
                .streaming(
                    &METHOD,
                    crate::rt::codegen::IntoStreamingRequest::into_streaming_request(
                        request,
                    ),
                )
                .await
        }
    }
    impl ::core::convert::From<crate::rt::codegen::Channel> for KvClient {
        fn from(inner: crate::rt::codegen::Channel) -> Self {
            Self { inner }
        }
    }
    impl ::core::convert::AsRef<crate::rt::codegen::Channel> for KvClient {
        fn as_ref(&self) -> &crate::rt::codegen::Channel {
            &self.inner
        }
    }
    /// Blocking calls of `store.v1.Kv` for the lowest latency: the calling thread polls the completion queue itself. The unary methods of [`KvClient`], under the same names; build it with `From` from a [`KvClient`] or a channel.
    #[derive(::core::fmt::Debug, ::core::clone::Clone)]
    pub struct KvBlockingClient {
        inner: crate::rt::codegen::Channel,
    }
    impl KvBlockingClient {
        /// A blocking client over `inner` (channels are cheap to clone and share).
        pub fn new(inner: crate::rt::codegen::Channel) -> Self {
            Self { inner }
        }
        /// A client whose calls pass `f` before they are sent (tonic's
        /// `with_interceptor`): see `Channel::with_interceptor`.
        pub fn with_interceptor<F: crate::rt::codegen::Interceptor>(
            inner: crate::rt::codegen::Channel,
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
            request: impl crate::rt::codegen::IntoRequest<crate::msgs::GetRequest>,
        ) -> ::core::result::Result<
            crate::rt::codegen::Response<super::GetReply>,
            crate::rt::codegen::Status,
        > {
            const METHOD: crate::rt::codegen::MethodDesc = crate::rt::codegen::MethodDesc::new(
                    "/store.v1.Kv/Get",
                    crate::rt::codegen::CallKind::Unary,
                )
                .with_idempotency(crate::rt::codegen::Idempotency::NoSideEffects);
            self.inner
                .unary_blocking(
                    &METHOD,
                    <_ as crate::rt::codegen::IntoRequest<
                        crate::msgs::GetRequest,
                    >>::into_request(request),
                )
        }
    }
    impl ::core::convert::From<crate::rt::codegen::Channel> for KvBlockingClient {
        fn from(inner: crate::rt::codegen::Channel) -> Self {
            Self { inner }
        }
    }
    impl ::core::convert::AsRef<crate::rt::codegen::Channel> for KvBlockingClient {
        fn as_ref(&self) -> &crate::rt::codegen::Channel {
            &self.inner
        }
    }
    impl ::core::convert::From<KvClient> for KvBlockingClient {
        fn from(client: KvClient) -> Self {
            Self { inner: client.inner }
        }
    }
    /// Pipelines of `store.v1.Kv`: one method per unary method of [`KvClient`], under the same name, opening a pipeline of that method (many calls in flight from one thread without async tasks: submit with a tag, collect responses with `poll`/`wait`). Build it with `From` from a [`KvClient`] or a channel.
    #[derive(::core::fmt::Debug, ::core::clone::Clone)]
    pub struct KvPipelineClient {
        inner: crate::rt::codegen::Channel,
    }
    impl KvPipelineClient {
        /// A pipeline client over `inner` (channels are cheap to clone and share).
        pub fn new(inner: crate::rt::codegen::Channel) -> Self {
            Self { inner }
        }
        /// A client whose calls pass `f` before they are sent (tonic's
        /// `with_interceptor`): see `Channel::with_interceptor`.
        pub fn with_interceptor<F: crate::rt::codegen::Interceptor>(
            inner: crate::rt::codegen::Channel,
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
            crate::rt::codegen::Pipeline<crate::msgs::GetRequest, super::GetReply>,
            crate::rt::codegen::Status,
        > {
            const METHOD: crate::rt::codegen::MethodDesc = crate::rt::codegen::MethodDesc::new(
                    "/store.v1.Kv/Get",
                    crate::rt::codegen::CallKind::Unary,
                )
                .with_idempotency(crate::rt::codegen::Idempotency::NoSideEffects);
            self.inner.pipeline(&METHOD)
        }
    }
    impl ::core::convert::From<crate::rt::codegen::Channel> for KvPipelineClient {
        fn from(inner: crate::rt::codegen::Channel) -> Self {
            Self { inner }
        }
    }
    impl ::core::convert::AsRef<crate::rt::codegen::Channel> for KvPipelineClient {
        fn as_ref(&self) -> &crate::rt::codegen::Channel {
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
pub(crate) mod kv_server {
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
    /// `/store.v1.Kv/Get`.
    pub const GET: crate::rt::codegen::MethodDesc = crate::rt::codegen::MethodDesc::new(
            "/store.v1.Kv/Get",
            crate::rt::codegen::CallKind::Unary,
        )
        .with_idempotency(crate::rt::codegen::Idempotency::NoSideEffects);
    /// `/store.v1.Kv/Watch`.
    pub const WATCH: crate::rt::codegen::MethodDesc = crate::rt::codegen::MethodDesc::new(
        "/store.v1.Kv/Watch",
        crate::rt::codegen::CallKind::Streaming,
    );
    /// A store.
    pub trait Kv: ::core::marker::Send + ::core::marker::Sync + 'static {
        /// Reads a key.
        fn get(
            &self,
            request: crate::rt::codegen::Request<crate::msgs::GetRequest>,
        ) -> impl crate::rt::codegen::Future<
            Output = ::core::result::Result<
                crate::rt::codegen::Response<super::GetReply>,
                crate::rt::codegen::Status,
            >,
        > + ::core::marker::Send;
        /// The stream of responses of [`Kv::watch`].
        type WatchStream: crate::rt::codegen::Stream<
                Item = ::core::result::Result<
                    ::events::Event,
                    crate::rt::codegen::Status,
                >,
            >
            + ::core::marker::Send
            + 'static;
        /// Handles `/store.v1.Kv/Watch`.
        fn watch(
            &self,
            request: crate::rt::codegen::Request<
                crate::rt::codegen::Streaming<super::super::WatchRequest>,
            >,
        ) -> impl crate::rt::codegen::Future<
            Output = ::core::result::Result<
                crate::rt::codegen::Response<Self::WatchStream>,
                crate::rt::codegen::Status,
            >,
        > + ::core::marker::Send;
    }
    /// Serves a [`Kv`] implementation as `store.v1.Kv`: hand it to the server builder's `add_service`.
    pub struct KvServer<T> {
        inner: crate::rt::codegen::Arc<T>,
    }
    impl<T> KvServer<T> {
        /// Every method of `store.v1.Kv`, in declaration order (also `Service::methods`).
        pub const METHODS: &'static [crate::rt::codegen::MethodDesc] = &[GET, WATCH];
    }
    impl<T: Kv> KvServer<T> {
        /// Serves `inner`.
        pub fn new(inner: T) -> Self {
            Self::from_arc(crate::rt::codegen::Arc::new(inner))
        }
        /// Serves a shared `inner`.
        pub fn from_arc(inner: crate::rt::codegen::Arc<T>) -> Self {
            Self { inner }
        }
        /// Serves `inner` with `f` run on every call's request metadata before its
        /// handler (tonic's `with_interceptor`); a status from `f` ends the call.
        pub fn with_interceptor<F: crate::rt::codegen::Interceptor>(
            inner: T,
            f: F,
        ) -> crate::rt::codegen::InterceptedService<Self, F> {
            crate::rt::codegen::InterceptedService::new(Self::new(inner), f)
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
    impl<T: Kv> crate::rt::codegen::Service for KvServer<T> {
        fn name(&self) -> &'static str {
            "store.v1.Kv"
        }
        fn methods(&self) -> &'static [crate::rt::codegen::MethodDesc] {
            Self::METHODS
        }
        fn call(
            &self,
            method: u32,
            call: crate::rt::codegen::IncomingCall<'_>,
        ) -> crate::rt::codegen::Dispatched {
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
