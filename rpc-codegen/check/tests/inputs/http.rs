//! `test/http.proto`: methods with `google.api.http` annotations.

use super::*;
use test::http::{
    Book, CreateBookRequest, GetShelfRequest, ListBooksReply, Shelf, library_client, library_server,
};

pub struct Svc;

impl test::http::library_server::Library for Svc {
    async fn get_shelf(&self, r: Request<GetShelfRequest>) -> Result<Response<Shelf>, Status> {
        let shelf = r.into_inner().shelf;
        Ok(Response::new(Shelf {
            theme: format!("theme of {shelf}"),
            name: shelf,
        }))
    }

    #[allow(deprecated)]
    async fn create_book(&self, r: Request<CreateBookRequest>) -> Result<Response<Book>, Status> {
        let r = r.into_inner();
        let mut book = r.book.ok_or_else(|| Status::invalid_argument("no book"))?;
        book.title = format!("{} ({})", book.title, r.shelf);
        Ok(Response::new(book))
    }

    async fn list_books(
        &self,
        r: Request<GetShelfRequest>,
    ) -> Result<Response<ListBooksReply>, Status> {
        let shelf = r.into_inner().shelf;
        Ok(Response::new(ListBooksReply {
            books: (1..=3)
                .map(|n| Book {
                    title: format!("{shelf} {n}"),
                    author: "anon".into(),
                })
                .collect(),
        }))
    }

    async fn delete_shelf(&self, r: Request<GetShelfRequest>) -> Result<Response<()>, Status> {
        if r.get_ref().shelf.is_empty() {
            return Err(Status::not_found("no such shelf"));
        }
        Ok(Response::new(()))
    }
}

#[tokio::test]
async fn http_annotated_methods_are_served_and_called() {
    let server = Server::builder().add_service(library_server::LibraryServer::new(Svc));
    with_server(server, |channel| async move {
        let client = library_client::LibraryClient::new(channel);
        let req = |s: &str| GetShelfRequest { shelf: s.into() };
        let shelf = client.get_shelf(req("poetry")).await.unwrap().into_inner();
        assert_eq!(
            (shelf.name.as_str(), shelf.theme.as_str()),
            ("poetry", "theme of poetry")
        );
        let book = client
            .create_book(CreateBookRequest {
                shelf: "poetry".into(),
                book: Some(Book {
                    title: "Odes".into(),
                    author: "Keats".into(),
                }),
            })
            .await
            .unwrap()
            .into_inner();
        assert_eq!(
            (book.title.as_str(), book.author.as_str()),
            ("Odes (poetry)", "Keats")
        );
        let books = client.list_books(req("sf")).await.unwrap().into_inner();
        assert_eq!(
            books
                .books
                .iter()
                .map(|b| b.title.as_str())
                .collect::<Vec<_>>(),
            ["sf 1", "sf 2", "sf 3"]
        );
        client.delete_shelf(req("sf")).await.unwrap();
        let err = client.delete_shelf(req("")).await.unwrap_err();
        assert_eq!(err.code(), Code::NotFound);
    })
    .await;
}

#[test]
fn http_annotation_messages_are_generated() {
    // The stand-in `google.api` package is generated like any other.
    use rpc_codegen_check::google::api::{CustomHttpPattern, HttpRule, http_rule};
    let rule = HttpRule {
        pattern: Some(http_rule::Pattern::Custom(CustomHttpPattern {
            kind: "HEAD".into(),
            path: "/v1/x".into(),
        })),
        additional_bindings: vec![HttpRule {
            pattern: Some(http_rule::Pattern::Get("/v1/y".into())),
            ..HttpRule::default()
        }],
        ..HttpRule::default()
    };
    let back = HttpRule::decode(rule.encode_to_vec().as_slice()).expect("round trip");
    assert_eq!(back, rule);
}
