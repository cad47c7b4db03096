//! `test/shapes.proto`: oneofs, maps, recursive and nested messages.

use super::*;
use test::common::Point;
use test::shapes::{
    A, B, Choice, Color, Index, Outer, Tree, b, choice, outer, shapes_client, shapes_server,
};

/// `tree` with its children in reverse order at every level, and a mirror note.
pub fn mirror(mut tree: Tree) -> Tree {
    tree.children.reverse();
    tree.children = tree.children.into_iter().map(mirror).collect();
    tree.mirror = Some(Box::new(Tree {
        name: format!("mirror of {}", tree.name),
        ..Tree::default()
    }));
    tree
}

/// Every node of `tree`, depth first, without their children.
pub fn walk(tree: &Tree, out: &mut Vec<Tree>) {
    out.push(Tree {
        name: tree.name.clone(),
        ..Tree::default()
    });
    for child in &tree.children {
        walk(child, out);
    }
}

pub struct Svc;

impl shapes_server::Shapes for Svc {
    async fn flip(&self, r: Request<Choice>) -> Result<Response<Choice>, Status> {
        use choice::{Pick, Tag};
        let c = r.into_inner();
        let pick = c.pick.map(|p| match p {
            Pick::Number(n) => Pick::Text(n.to_string()),
            Pick::Text(t) => Pick::Number(t.len() as i64),
            Pick::Flag(f) => Pick::Flag(!f),
            Pick::Raw(mut r) => {
                r.reverse();
                Pick::Raw(r)
            }
            Pick::Ratio(x) => Pick::Ratio(1.0 / x),
            Pick::Color(c) => Pick::Color(if c == Color::Red as i32 {
                Color::Green as i32
            } else {
                Color::Red as i32
            }),
            Pick::Nested(inner) => Pick::Nested(Box::new(Choice {
                pick: Some(Pick::Text(format!("{:?}", inner.pick.is_some()))),
                tag: inner.tag,
            })),
            Pick::Point(p) => Pick::Point(test::common::Point {
                latitude: p.longitude,
                longitude: p.latitude,
            }),
            Pick::Tree(t) => Pick::Text(t.name),
        });
        let tag = c.tag.map(|t| match t {
            Tag::Label(l) => Tag::Code(l.len() as u32),
            Tag::Code(n) => Tag::Label(n.to_string()),
        });
        Ok(Response::new(Choice { pick, tag }))
    }

    async fn reindex(&self, r: Request<Index>) -> Result<Response<Index>, Status> {
        let i = r.into_inner();
        Ok(Response::new(Index {
            trees: i
                .trees
                .into_iter()
                .map(|(k, t)| (k.to_uppercase(), mirror(t)))
                .collect(),
            blobs: i
                .blobs
                .into_iter()
                .map(|(k, mut v)| {
                    v.reverse();
                    (-k, v)
                })
                .collect(),
            colors: i
                .colors
                .into_iter()
                .map(|(k, c)| (k, (c + 1) % 3))
                .collect(),
            points: i.points.into_iter().map(|(k, p)| (k * 10, p)).collect(),
            flags: i.flags.into_iter().map(|(k, v)| (!k, v)).collect(),
            choices: i.choices.into_iter().map(|(k, c)| (k - 1, c)).collect(),
        }))
    }

    async fn mirror(&self, r: Request<Tree>) -> Result<Response<Tree>, Status> {
        Ok(Response::new(mirror(r.into_inner())))
    }

    async fn deepen(&self, r: Request<A>) -> Result<Response<B>, Status> {
        let a = r.into_inner();
        let note = format!("depth {}, {} bs", a.depth, a.bs.len());
        let deeper = A {
            depth: a.depth + 1,
            ..a.clone()
        };
        Ok(Response::new(B {
            note,
            a: Some(Box::new(a)),
            back: Some(b::Back::Again(Box::new(deeper))),
        }))
    }

    async fn descend(
        &self,
        r: Request<outer::middle::Inner>,
    ) -> Result<Response<outer::Middle>, Status> {
        let inner = r.into_inner();
        let flipped = outer::middle::Inner {
            outer_mode: outer::Mode::Fast as i32,
            middle_mode: outer::middle::Mode::Slow as i32,
            back: Some(Box::new(Outer {
                mode: inner.outer_mode,
                maybe: Some(inner.middle_mode),
                ..Outer::default()
            })),
        };
        Ok(Response::new(outer::Middle {
            inner: Some(Box::new(inner)),
            more: vec![flipped],
        }))
    }

    type WalkStream = Iter<Tree>;

    async fn walk(&self, r: Request<Tree>) -> Result<Response<Iter<Tree>>, Status> {
        let mut nodes = Vec::new();
        walk(r.get_ref(), &mut nodes);
        Ok(Response::new(Iter::new(nodes)))
    }
}

fn leaf(name: &str) -> test::shapes::Tree {
    test::shapes::Tree {
        name: name.into(),
        ..Default::default()
    }
}

fn node(name: &str, children: Vec<test::shapes::Tree>) -> test::shapes::Tree {
    test::shapes::Tree {
        children,
        ..leaf(name)
    }
}

#[tokio::test]
async fn oneofs_maps_and_recursive_messages_are_served_and_called() {
    let server = Server::builder().add_service(shapes_server::ShapesServer::new(Svc));
    with_server(server, |channel| async move {
        let client = shapes_client::ShapesClient::new(channel);
        let flip = |pick: Option<choice::Pick>, tag: Option<choice::Tag>| {
            let client = client.clone();
            async move {
                let c = client
                    .flip(Choice { pick, tag })
                    .await
                    .unwrap()
                    .into_inner();
                (c.pick, c.tag)
            }
        };
        use choice::{Pick, Tag};

        // Oneofs of scalars, of messages, and two in one message.
        assert_eq!(
            flip(Some(Pick::Number(1234)), Some(Tag::Label("abc".into()))).await,
            (Some(Pick::Text("1234".into())), Some(Tag::Code(3)))
        );
        assert_eq!(
            flip(Some(Pick::Text("four".into())), Some(Tag::Code(9))).await,
            (Some(Pick::Number(4)), Some(Tag::Label("9".into())))
        );
        assert_eq!(
            flip(Some(Pick::Flag(false)), None).await.0,
            Some(Pick::Flag(true))
        );
        assert_eq!(
            flip(Some(Pick::Raw(vec![1, 2, 3])), None).await.0,
            Some(Pick::Raw(vec![3, 2, 1]))
        );
        assert_eq!(
            flip(Some(Pick::Ratio(4.0)), None).await.0,
            Some(Pick::Ratio(0.25))
        );
        assert_eq!(
            flip(Some(Pick::Color(Color::Red as i32)), None).await.0,
            Some(Pick::Color(Color::Green as i32))
        );
        assert_eq!(
            flip(
                Some(Pick::Point(Point {
                    latitude: 1,
                    longitude: 2
                })),
                None
            )
            .await
            .0,
            Some(Pick::Point(Point {
                latitude: 2,
                longitude: 1
            }))
        );
        assert_eq!(
            flip(Some(Pick::Tree(leaf("oak"))), None).await.0,
            Some(Pick::Text("oak".into()))
        );
        let nested = Choice {
            pick: Some(Pick::Flag(true)),
            tag: Some(Tag::Code(5)),
        };
        assert_eq!(
            flip(Some(Pick::Nested(Box::new(nested))), None).await.0,
            Some(Pick::Nested(Box::new(Choice {
                pick: Some(Pick::Text("true".into())),
                tag: Some(Tag::Code(5)),
            })))
        );
        assert_eq!(flip(None, None).await, (None, None));

        // Maps keyed by strings, integers and bools, with message, bytes and enum values.
        let index = Index {
            trees: HashMap::from([("oak".into(), node("o", vec![leaf("1"), leaf("2")]))]),
            blobs: HashMap::from([(7, vec![1, 2]), (-3, vec![])]),
            colors: HashMap::from([
                ("sky".into(), Color::Unspecified as i32),
                ("leaf".into(), Color::Green as i32),
            ]),
            points: HashMap::from([(
                4,
                Point {
                    latitude: 5,
                    longitude: 6,
                },
            )]),
            flags: HashMap::from([(true, "yes".into())]),
            choices: HashMap::from([(
                -1,
                Choice {
                    pick: Some(Pick::Number(1)),
                    tag: None,
                },
            )]),
        };
        let i = client.reindex(index).await.unwrap().into_inner();
        assert_eq!(
            i.trees["OAK"]
                .children
                .iter()
                .map(|t| t.name.as_str())
                .collect::<Vec<_>>(),
            ["2", "1"]
        );
        assert_eq!(i.blobs, HashMap::from([(-7, vec![2u8, 1]), (3, vec![])]));
        assert_eq!(
            i.colors,
            HashMap::from([
                ("sky".into(), Color::Red as i32),
                ("leaf".into(), Color::Unspecified as i32),
            ])
        );
        assert_eq!(i.points[&40].longitude, 6);
        assert_eq!(i.flags, HashMap::from([(false, "yes".into())]));
        assert_eq!(i.choices[&-2].pick, Some(Pick::Number(1)));

        // A 3-level recursive tree, mirrored at every level.
        let tree = node(
            "root",
            vec![
                node("a", vec![leaf("a1"), leaf("a2")]),
                node("b", vec![node("b1", vec![leaf("b1x"), leaf("b1y")])]),
            ],
        );
        let m = client.mirror(tree.clone()).await.unwrap().into_inner();
        let names = |t: &test::shapes::Tree| -> Vec<String> {
            t.children.iter().map(|c| c.name.clone()).collect()
        };
        assert_eq!(names(&m), ["b", "a"]);
        assert_eq!(names(&m.children[1]), ["a2", "a1"]);
        assert_eq!(names(&m.children[0].children[0]), ["b1y", "b1x"]);
        assert_eq!(m.mirror.as_ref().unwrap().name, "mirror of root");
        assert_eq!(
            m.children[0].children[0].mirror.as_ref().unwrap().name,
            "mirror of b1"
        );
        // Depth first, streamed.
        let walked = collect(client.walk(tree).await.unwrap()).await;
        let order: Vec<&str> = walked.iter().map(|t| t.name.as_str()).collect();
        assert_eq!(order, ["root", "a", "a1", "a2", "b", "b1", "b1x", "b1y"]);

        // Mutual recursion: A -> B -> A.
        let a = A {
            depth: 1,
            b: Some(Box::new(B {
                note: "inner".into(),
                a: Some(Box::new(A {
                    depth: 0,
                    ..A::default()
                })),
                back: Some(b::Back::Self_(Box::default())),
            })),
            bs: vec![B::default(), B::default()],
        };
        let b = client.deepen(a.clone()).await.unwrap().into_inner();
        assert_eq!(b.note, "depth 1, 2 bs");
        assert_eq!(b.a.as_deref(), Some(&a));
        let Some(b::Back::Again(deeper)) = &b.back else {
            panic!("expected `again`: {b:?}");
        };
        assert_eq!(deeper.depth, 2);
        assert_eq!(deeper.b.as_ref().unwrap().a.as_ref().unwrap().depth, 0);

        // Nested messages and enums three levels down, as request and response.
        let inner = outer::middle::Inner {
            outer_mode: outer::Mode::Unspecified as i32,
            middle_mode: outer::middle::Mode::Slow as i32,
            back: None,
        };
        let middle = client.descend(inner.clone()).await.unwrap().into_inner();
        assert_eq!(middle.inner.as_deref(), Some(&inner));
        assert_eq!(middle.more[0].outer_mode, outer::Mode::Fast as i32);
        assert_eq!(
            middle.more[0].back.as_deref(),
            Some(&Outer {
                mode: 0,
                maybe: Some(1),
                middle: None,
            })
        );
    })
    .await;
}
