//! `test/split/`: one package declared by three files, `import public`, and another package
//! on its messages.

use super::*;
use test::audit::{audit_client, audit_server};
use test::split::{Item, Order, Receipt, ledger_client, ledger_server, shop_client, shop_server};

pub struct Svc;

fn receipt(order: Order) -> Receipt {
    Receipt {
        total_items: order.items.iter().map(|i| i.quantity).sum(),
        order: Some(order),
    }
}

impl shop_server::Shop for Svc {
    async fn place(&self, r: Request<Order>) -> Result<Response<Receipt>, Status> {
        Ok(Response::new(receipt(r.into_inner())))
    }

    async fn destination(
        &self,
        r: Request<Order>,
    ) -> Result<Response<test::common::Point>, Status> {
        r.into_inner()
            .deliver_to
            .map(Response::new)
            .ok_or_else(|| Status::failed_precondition("no destination"))
    }

    async fn mark(
        &self,
        r: Request<test::reexport::Marker>,
    ) -> Result<Response<test::reexport::Marker>, Status> {
        let mut m = r.into_inner();
        m.origin.push_str(" via shop");
        Ok(Response::new(m))
    }
}

impl ledger_server::Ledger for Svc {
    async fn record(&self, r: Request<Receipt>) -> Result<Response<Receipt>, Status> {
        let mut receipt = r.into_inner();
        receipt.total_items *= 10;
        Ok(Response::new(receipt))
    }
}

impl test::audit::audit_server::Audit for Svc {
    async fn check(&self, r: Request<Order>) -> Result<Response<Receipt>, Status> {
        let mut receipt = receipt(r.into_inner());
        receipt.total_items += 1000;
        Ok(Response::new(receipt))
    }
}

#[tokio::test]
async fn split_packages_are_served_and_called() {
    let server = Server::builder()
        .add_service(shop_server::ShopServer::new(Svc))
        .add_service(ledger_server::LedgerServer::new(Svc))
        .add_service(audit_server::AuditServer::new(Svc));
    with_server(server, |channel| async move {
        let order = Order {
            id: 77,
            items: vec![
                Item {
                    sku: "nail".into(),
                    quantity: 100,
                },
                Item {
                    sku: "hammer".into(),
                    quantity: 1,
                },
            ],
            deliver_to: Some(test::common::Point {
                latitude: 48,
                longitude: 2,
            }),
        };
        // A service of one file on messages of the two other files of its package.
        let shop = shop_client::ShopClient::new(channel.clone());
        let receipt = shop.place(order.clone()).await.unwrap().into_inner();
        assert_eq!(receipt.total_items, 101);
        assert_eq!(receipt.order.as_ref(), Some(&order));
        // `test.common.Point`, seen through `import public`.
        let to = shop.destination(order.clone()).await.unwrap().into_inner();
        assert_eq!((to.latitude, to.longitude), (48, 2));
        let err = shop.destination(Order::default()).await.unwrap_err();
        assert_eq!(err.code(), Code::FailedPrecondition);
        let marker = shop
            .mark(test::reexport::Marker {
                origin: "test".into(),
            })
            .await
            .unwrap()
            .into_inner();
        assert_eq!(marker.origin, "test via shop");

        // The package's other service, declared in another file.
        let ledger = ledger_client::LedgerClient::new(channel.clone());
        let recorded = ledger.record(receipt).await.unwrap().into_inner();
        assert_eq!(recorded.total_items, 1010);

        // Another package on this package's messages.
        let audit = audit_client::AuditClient::new(channel);
        let checked = audit.check(order).await.unwrap().into_inner();
        assert_eq!(checked.total_items, 1101);
        assert_eq!(checked.order.unwrap().id, 77);
    })
    .await;
}
