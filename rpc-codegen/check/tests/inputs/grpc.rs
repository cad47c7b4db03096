//! The same implementations served over gRPC (tonic) through the generated adapters, and
//! called with tonic's generated clients.

use super::*;

#[tokio::test]
async fn new_inputs_serve_grpc_through_the_tonic_adapters() {
    use test::wkt::{Reading, well_known_tonic};
    tokio::time::timeout(Duration::from_secs(30), async {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let url = format!("http://{}", listener.local_addr().unwrap());
        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        let wkt = well_known_tonic::WellKnownTonicAdapter::new(super::wkt::Svc);
        let legacy = test::legacy::legacy_tonic::LegacyTonicAdapter::new(super::legacy::Svc);
        let library = test::http::library_tonic::LibraryTonicAdapter::new(super::http::Svc);
        let shop = test::split::shop_tonic::ShopTonicAdapter::new(super::split::Svc);
        let server = tokio::spawn(async move {
            tonic::transport::Server::builder()
                .add_service(wkt.into_service())
                .add_service(legacy.into_service())
                .add_service(library.into_service())
                .add_service(shop.into_service())
                .serve_with_incoming_shutdown(
                    tokio_stream::wrappers::TcpListenerStream::new(listener),
                    async {
                        let _ = stopped.await;
                    },
                )
                .await
                .unwrap();
        });

        // Wrappers as primitives (`i64`, `bool`, `f32`..) and `Any` over gRPC.
        let mut client = well_known_tonic::well_known_client::WellKnownClient::connect(url.clone())
            .await
            .unwrap();
        let n = client.length(String::from("héllo")).await.unwrap();
        assert_eq!(n.into_inner(), 5);
        assert!(client.negate(false).await.unwrap().into_inner());
        assert_eq!(client.halve(3.0).await.unwrap().into_inner(), 1.5f32);
        let any = client
            .unpack(super::wkt::pack(&Reading {
                sensor: "grpc".into(),
                celsius: -4.0,
            }))
            .await
            .unwrap()
            .into_inner();
        assert_eq!(super::wkt::unpack(&any).unwrap().sensor, "GRPC");
        let mut spread = client
            .spread(ListValue {
                values: vec![super::wkt::number(1.0), super::wkt::number(2.0)],
            })
            .await
            .unwrap()
            .into_inner();
        let mut got = Vec::new();
        while let Some(v) = spread.message().await.unwrap() {
            got.push(v);
        }
        assert_eq!(got, [super::wkt::number(1.0), super::wkt::number(2.0)]);

        // proto2 defaults over gRPC.
        let mut legacy =
            test::legacy::legacy_tonic::legacy_client::LegacyClient::connect(url.clone())
                .await
                .unwrap();
        let c = legacy
            .apply(test::legacy::Config {
                name: "g".into(),
                ..Default::default()
            })
            .await
            .unwrap()
            .into_inner();
        assert_eq!((c.retries, c.mode.as_deref()), (Some(3), Some("fast")));

        // HTTP-annotated methods and a split package's service.
        let mut library =
            test::http::library_tonic::library_client::LibraryClient::connect(url.clone())
                .await
                .unwrap();
        let shelf = library
            .get_shelf(test::http::GetShelfRequest {
                shelf: "maps".into(),
            })
            .await
            .unwrap()
            .into_inner();
        assert_eq!(shelf.theme, "theme of maps");
        let err = library
            .delete_shelf(test::http::GetShelfRequest::default())
            .await
            .unwrap_err();
        assert_eq!(err.code(), tonic::Code::NotFound);
        let mut shop = test::split::shop_tonic::shop_client::ShopClient::connect(url)
            .await
            .unwrap();
        let receipt = shop
            .place(test::split::Order {
                items: vec![test::split::Item {
                    sku: "a".into(),
                    quantity: 4,
                }],
                ..Default::default()
            })
            .await
            .unwrap()
            .into_inner();
        assert_eq!(receipt.total_items, 4);

        let _ = stop.send(());
        server.await.unwrap();
    })
    .await
    .expect("the tonic test took more than 30 s");
}
