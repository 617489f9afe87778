//! `feedstore stream`: list a daemon's streams, close one.

use anyhow::{Context, bail};
use feedstore_proto::Role;
use feedstore_proto::frame::StreamInfo;

use crate::SocketArg;

/// Arguments of `feedstore stream`.
#[derive(Debug, clap::Args)]
pub struct Args {
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, clap::Subcommand)]
enum Command {
    /// List this uid's streams on the daemon (root: every uid's): producers, ranks attached,
    /// samples ready and put, lag. A stream stays listed (holding its ready samples) after its last epoch until
    /// it is closed or expires idle.
    List {
        #[command(flatten)]
        socket: SocketArg,
        /// Print one JSON object per stream, a line each.
        #[arg(long)]
        json: bool,
    },
    /// Close a stream for everyone: its ready samples go back to the store, its producers and
    /// consumers see it end. Needs the uid that made it (or root).
    Close {
        #[command(flatten)]
        socket: SocketArg,
        /// The stream's name.
        name: String,
        /// The uid whose stream it is, where several uids have one of that name (root sees all).
        #[arg(long)]
        uid: Option<u32>,
    },
}

pub fn run(args: Args) -> anyhow::Result<()> {
    match args.command {
        Command::List { socket, json } => list(socket, json),
        Command::Close { socket, name, uid } => close(socket, &name, uid),
    }
}

fn list(socket: SocketArg, json: bool) -> anyhow::Result<()> {
    let client = socket.inspect(Role::Reader, "feedstore-stream-list")?;
    let streams = client.streams().context("listing streams")?;
    if json {
        for t in &streams {
            println!("{}", row(t));
        }
        return Ok(());
    }
    if streams.is_empty() {
        println!("no streams");
        return Ok(());
    }
    println!(
        "{:<24} {:>6} {:>9} {:>11} {:>8} {:>10} {:>10} {:>6}",
        "name", "uid", "producers", "ranks", "ready", "put", "returned", "lag"
    );
    for t in &streams {
        println!(
            "{:<24} {:>6} {:>9} {:>11} {:>8} {:>10} {:>10} {:>6}",
            t.name,
            t.owner_uid,
            t.producers,
            format!("{}/{} read", t.consumers, t.ranks),
            t.ready,
            t.put,
            t.returned,
            t.fastest - t.slowest
        );
    }
    Ok(())
}

fn row(t: &StreamInfo) -> serde_json::Value {
    serde_json::json!({
        "id": t.id, "owner_uid": t.owner_uid, "name": t.name, "depth": t.depth,
        "producers": t.producers, "consumers": t.consumers, "ranks": t.ranks,
        "ready": t.ready, "making": t.making, "put": t.put, "returned": t.returned,
        "slowest": t.slowest, "fastest": t.fastest, "cold_start_us": t.cold_start_us,
    })
}

fn close(socket: SocketArg, name: &str, uid: Option<u32>) -> anyhow::Result<()> {
    let client = socket.inspect(Role::Writer, "feedstore-stream-close")?;
    let streams = client.streams().context("listing streams")?;
    let named: Vec<&StreamInfo> = streams
        .iter()
        .filter(|t| t.name == name && uid.is_none_or(|u| t.owner_uid == u))
        .collect();
    let stream = match named[..] {
        [one] => one,
        [] => bail!(
            "no stream named {name:?}{} on the daemon (`feedstore stream list` shows them)",
            uid.map_or(String::new(), |u| format!(" of uid {u}"))
        ),
        _ => bail!(
            "streams named {name:?} belong to uids {:?}: say which with --uid",
            named.iter().map(|t| t.owner_uid).collect::<Vec<_>>()
        ),
    };
    client
        .close_stream(stream.id)
        .with_context(|| format!("closing stream {name:?}"))?;
    println!(
        "closed stream {name:?}: {} ready sample(s) went back to the store",
        stream.ready
    );
    Ok(())
}
