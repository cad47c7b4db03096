//! Route guide: gRPC's streaming tutorial service on rdma-rpc, all four call kinds in one
//! command. The server and the client run in one process (over the soft provider by default,
//! or the one `RPC_PROVIDER` names), and the client prints what happens:
//!
//! - `get_feature` (unary): the feature at a point;
//! - `list_features` (server streaming): the features inside a rectangle, as they arrive; then
//!   the same call dropped after three features (a cancel);
//! - `record_route` (client streaming): points sent one by one, then the route's summary;
//! - `route_chat` (bidirectional): notes sent while earlier notes at the same place come back.
//!
//! ```sh
//! cargo run --release -p rpc-examples --bin route_guide
//! ```
//!
//! The service is a Rust trait with `#[rpc_derive::service]`; a `.proto` with the same
//! `service RouteGuide` generates the same client and server.

use std::collections::HashMap;
use std::pin::Pin;
use std::sync::{Arc, Mutex, PoisonError};
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use rpc_core::server::Server;
use rpc_core::{Status, Stream, Streaming};
use tokio::sync::mpsc;

// ----- messages (as gRPC's route_guide.proto) ---------------------------------------------------

/// A point, latitude and longitude in degrees times 10^7.
#[derive(Clone, Copy, PartialEq, Eq, Hash, prost::Message)]
pub struct Point {
    #[prost(int32, tag = "1")]
    pub latitude: i32,
    #[prost(int32, tag = "2")]
    pub longitude: i32,
}

/// A rectangle given by two opposite corners.
#[derive(Clone, PartialEq, prost::Message)]
pub struct Rectangle {
    #[prost(message, optional, tag = "1")]
    pub lo: Option<Point>,
    #[prost(message, optional, tag = "2")]
    pub hi: Option<Point>,
}

/// Something at a location; an empty name means nothing is there.
#[derive(Clone, PartialEq, prost::Message)]
pub struct Feature {
    #[prost(string, tag = "1")]
    pub name: String,
    #[prost(message, optional, tag = "2")]
    pub location: Option<Point>,
}

/// A message left at a location.
#[derive(Clone, PartialEq, prost::Message)]
pub struct RouteNote {
    #[prost(message, optional, tag = "1")]
    pub location: Option<Point>,
    #[prost(string, tag = "2")]
    pub message: String,
}

/// What `record_route` saw of a route.
#[derive(Clone, PartialEq, prost::Message)]
pub struct RouteSummary {
    #[prost(int32, tag = "1")]
    pub point_count: i32,
    #[prost(int32, tag = "2")]
    pub feature_count: i32,
    /// Metres.
    #[prost(int32, tag = "3")]
    pub distance: i32,
    /// Seconds.
    #[prost(int32, tag = "4")]
    pub elapsed_time: i32,
}

/// The route guide: paths `/routeguide.RouteGuide/GetFeature` and so on, as gRPC's.
#[rpc_derive::service(package = "routeguide")]
pub trait RouteGuide {
    /// Unary: the feature at a point (one with an empty name when there is none).
    async fn get_feature(&self, request: Point) -> Result<Feature, Status>;

    /// The stream `list_features` answers with.
    type Features: Stream<Item = Result<Feature, Status>>;

    /// Server streaming: the features inside a rectangle.
    async fn list_features(&self, request: Rectangle) -> Result<Self::Features, Status>;

    /// Client streaming: the summary of a route, once the client has sent all its points.
    async fn record_route(&self, request: Streaming<Point>) -> Result<RouteSummary, Status>;

    /// The stream `route_chat` answers with.
    type Notes: Stream<Item = Result<RouteNote, Status>>;

    /// Bidirectional: each note received is answered with the notes left at its location
    /// before.
    async fn route_chat(&self, request: Streaming<RouteNote>) -> Result<Self::Notes, Status>;
}

// ----- the server -------------------------------------------------------------------------------

/// The receiving half of a channel as a `Stream` (what `tokio_stream::wrappers` offers).
#[derive(Debug)]
pub struct ChannelStream<T>(mpsc::Receiver<T>);

impl<T> Stream for ChannelStream<T> {
    type Item = T;

    fn poll_next(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<T>> {
        self.get_mut().0.poll_recv(cx)
    }
}

struct Guide {
    features: Arc<Vec<Feature>>,
    notes: Arc<Mutex<HashMap<Point, Vec<RouteNote>>>>,
}

impl Guide {
    fn feature_at(&self, p: Point) -> Option<&Feature> {
        self.features
            .iter()
            .find(|f| f.location == Some(p) && !f.name.is_empty())
    }
}

fn inside(r: &Rectangle, p: Point) -> bool {
    let (Some(lo), Some(hi)) = (r.lo, r.hi) else {
        return false;
    };
    let (lat, lon) = (p.latitude, p.longitude);
    lat >= lo.latitude.min(hi.latitude)
        && lat <= lo.latitude.max(hi.latitude)
        && lon >= lo.longitude.min(hi.longitude)
        && lon <= lo.longitude.max(hi.longitude)
}

/// Great-circle distance in metres (haversine).
fn distance(a: Point, b: Point) -> f64 {
    const E7: f64 = 1e7;
    const EARTH_RADIUS_M: f64 = 6_371_000.0;
    let (lat1, lat2) = (
        (f64::from(a.latitude) / E7).to_radians(),
        (f64::from(b.latitude) / E7).to_radians(),
    );
    let dlat = lat2 - lat1;
    let dlon = (f64::from(b.longitude - a.longitude) / E7).to_radians();
    let h = (dlat / 2.0).sin().powi(2) + lat1.cos() * lat2.cos() * (dlon / 2.0).sin().powi(2);
    2.0 * EARTH_RADIUS_M * h.sqrt().atan2((1.0 - h).sqrt())
}

impl RouteGuide for Guide {
    async fn get_feature(&self, request: Point) -> Result<Feature, Status> {
        Ok(self.feature_at(request).cloned().unwrap_or(Feature {
            name: String::new(),
            location: Some(request),
        }))
    }

    type Features = ChannelStream<Result<Feature, Status>>;

    async fn list_features(&self, request: Rectangle) -> Result<Self::Features, Status> {
        if request.lo.is_none() || request.hi.is_none() {
            return Err(Status::invalid_argument("a rectangle needs both corners"));
        }
        // A small channel: the producer waits while the client's stream window is full, and
        // stops when the client drops the stream (the receiver goes away).
        let (tx, rx) = mpsc::channel(4);
        let features = Arc::clone(&self.features);
        tokio::spawn(async move {
            for f in features.iter() {
                if let Some(p) = f.location
                    && !f.name.is_empty()
                    && inside(&request, p)
                    && tx.send(Ok(f.clone())).await.is_err()
                {
                    return;
                }
            }
        });
        Ok(ChannelStream(rx))
    }

    async fn record_route(&self, mut request: Streaming<Point>) -> Result<RouteSummary, Status> {
        let start = Instant::now();
        let mut summary = RouteSummary::default();
        let mut last = None;
        let mut metres = 0.0;
        while let Some(p) = request.message().await? {
            summary.point_count += 1;
            if self.feature_at(p).is_some() {
                summary.feature_count += 1;
            }
            if let Some(prev) = last {
                metres += distance(prev, p);
            }
            last = Some(p);
        }
        summary.distance = metres as i32;
        summary.elapsed_time = start.elapsed().as_secs() as i32;
        Ok(summary)
    }

    type Notes = ChannelStream<Result<RouteNote, Status>>;

    async fn route_chat(&self, mut request: Streaming<RouteNote>) -> Result<Self::Notes, Status> {
        let (tx, rx) = mpsc::channel(16);
        let notes = Arc::clone(&self.notes);
        tokio::spawn(async move {
            loop {
                let note = match request.message().await {
                    Ok(Some(n)) => n,
                    Ok(None) => return, // the client half-closed: the chat ends
                    Err(e) => {
                        let _ = tx.send(Err(e)).await;
                        return;
                    }
                };
                let Some(at) = note.location else {
                    let _ = tx
                        .send(Err(Status::invalid_argument("a note needs a location")))
                        .await;
                    return;
                };
                let earlier = {
                    let mut map = notes.lock().unwrap_or_else(PoisonError::into_inner);
                    let here = map.entry(at).or_default();
                    let earlier = here.clone();
                    here.push(note);
                    earlier
                };
                for n in earlier {
                    if tx.send(Ok(n)).await.is_err() {
                        return;
                    }
                }
            }
        });
        Ok(ChannelStream(rx))
    }
}

/// A map with a feature every 0.1 degree on a 10 x 10 grid near New York; a few are unnamed.
fn features() -> Vec<Feature> {
    let mut v = Vec::new();
    for i in 0..10 {
        for j in 0..10 {
            let name = if (i * 10 + j) % 7 == 3 {
                String::new()
            } else {
                format!("Landmark {i}-{j}")
            };
            v.push(Feature {
                name,
                location: Some(point(i, j)),
            });
        }
    }
    v
}

fn point(i: i32, j: i32) -> Point {
    Point {
        latitude: 404_000_000 + i * 1_000_000,
        longitude: -744_000_000 + j * 1_000_000,
    }
}

fn show(p: Option<Point>) -> String {
    match p {
        Some(p) => format!(
            "({:.1}, {:.1})",
            f64::from(p.latitude) / 1e7,
            f64::from(p.longitude) / 1e7
        ),
        None => "(nowhere)".into(),
    }
}

// ----- the client -------------------------------------------------------------------------------

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    rpc_examples::init_tracing();
    let guide = Guide {
        features: Arc::new(features()),
        notes: Arc::default(),
    };
    let server = Server::builder()
        .add_service(route_guide_server::RouteGuideServer::new(guide))
        .bind("127.0.0.1:0")
        .await?;
    let addr = server.local_addr();
    println!("route_guide: server on {addr}");
    let client = route_guide_client::RouteGuideClient::connect(addr.to_string()).await?;

    // Unary.
    for p in [point(2, 5), point(0, 3)] {
        let f = client.get_feature(p).await?.into_inner();
        if f.name.is_empty() {
            println!("get_feature {}: nothing there", show(Some(p)));
        } else {
            println!("get_feature {}: {:?}", show(Some(p)), f.name);
        }
    }

    // Server streaming: returns once the request is sent; features arrive on the stream.
    let rect = Rectangle {
        lo: Some(point(1, 1)),
        hi: Some(point(3, 4)),
    };
    let t0 = Instant::now();
    let mut features = client.list_features(rect.clone()).await?.into_inner();
    let mut n = 0;
    while let Some(f) = features.message().await? {
        n += 1;
        if n <= 3 {
            println!("list_features: {:?} at {}", f.name, show(f.location));
        }
    }
    println!(
        "list_features: {n} features in {} x {} in {:?}",
        show(rect.lo),
        show(rect.hi),
        t0.elapsed()
    );
    // Dropping the stream cancels the call: the server stops producing.
    let mut features = client
        .list_features(Rectangle {
            lo: Some(point(0, 0)),
            hi: Some(point(9, 9)),
        })
        .await?
        .into_inner();
    for _ in 0..3 {
        features.message().await?;
    }
    drop(features);
    println!("list_features: whole map, dropped after 3 features (cancelled)");

    // Client streaming: the points go out as the stream yields them; the summary comes back
    // once the stream ends.
    let (tx, rx) = mpsc::channel(4);
    tokio::spawn(async move {
        let mut seed = 7u32;
        for _ in 0..10 {
            seed = seed.wrapping_mul(1_103_515_245).wrapping_add(12_345);
            let (i, j) = ((seed >> 8) % 10, (seed >> 16) % 10);
            if tx.send(point(i as i32, j as i32)).await.is_err() {
                return;
            }
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    });
    let summary = client.record_route(ChannelStream(rx)).await?.into_inner();
    println!(
        "record_route: {} points, {} features, {:.1} km",
        summary.point_count,
        summary.feature_count,
        f64::from(summary.distance) / 1000.0
    );

    // Bidirectional: notes go out while earlier notes at the same place come back.
    let (tx, rx) = mpsc::channel(4);
    let mut replies = client.route_chat(ChannelStream(rx)).await?.into_inner();
    let plan = [
        ("First message", point(0, 0)),
        ("Second message", point(0, 1)),
        ("Third message", point(1, 0)),
        ("Fourth message", point(0, 0)),
        ("Fifth message", point(0, 1)),
    ];
    let sender = tokio::spawn(async move {
        for (message, at) in plan {
            println!("route_chat: send {message:?} at {}", show(Some(at)));
            let note = RouteNote {
                location: Some(at),
                message: message.into(),
            };
            if tx.send(note).await.is_err() {
                return;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        println!("route_chat: client done sending (half-close), still receiving");
    });
    while let Some(note) = replies.message().await? {
        println!(
            "route_chat: got {:?} left at {}",
            note.message,
            show(note.location)
        );
    }
    sender.await?;
    println!("route_chat: the server ended the chat");

    tokio::time::timeout(Duration::from_secs(10), server.shutdown()).await?;
    Ok(())
}
