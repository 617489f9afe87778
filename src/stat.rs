//! `feedstore stat`.

use anyhow::Context;
use feedstore_consumer::ConnectOptions;
use feedstore_proto::Role;
use feedstore_store::config::format_bytes;

use crate::SocketArg;

/// Arguments of `feedstore stat`.
#[derive(Debug, clap::Args)]
pub struct Args {
    #[command(flatten)]
    socket: SocketArg,
    /// Print one JSON object instead of a table.
    #[arg(long)]
    json: bool,
}

pub fn run(args: Args) -> anyhow::Result<()> {
    let socket = args.socket.path();
    let client = ConnectOptions::new(Role::Reader)
        .socket(&socket)
        .name("feedstore-stat")
        .populate(false)
        .connect()?;
    let s = client.stats().context("reading statistics")?;
    if args.json {
        println!(
            "{{\"capacity_bytes\":{},\"used_bytes\":{},\"free_bytes\":{},\"largest_free_bytes\":{},\
             \"fragmentation\":{:.4},\"objects_sealed\":{},\"objects_writing\":{},\"objects_pinned\":{},\
             \"objects_delete_pending\":{},\"leases\":{},\"clients\":{},\"evictions\":{},\"evicted_bytes\":{},\
             \"creates_waited\":{},\"creates_full\":{},\"aborted_on_disconnect\":{},\"leases_reclaimed\":{},\
             \"segments\":{},\"huge_pages\":{}}}",
            s.capacity_bytes,
            s.used_bytes,
            s.free_bytes(),
            s.largest_free_bytes,
            s.fragmentation(),
            s.objects_sealed,
            s.objects_writing,
            s.objects_pinned,
            s.objects_delete_pending,
            s.leases,
            s.clients,
            s.evictions,
            s.evicted_bytes,
            s.creates_waited,
            s.creates_full,
            s.aborted_on_disconnect,
            s.leases_reclaimed,
            s.segments,
            s.huge_pages != 0
        );
        return Ok(());
    }
    let pct = |a: u64, b: u64| {
        if b == 0 {
            0.0
        } else {
            100.0 * a as f64 / b as f64
        }
    };
    println!(
        "feedstored at {} (node {:08x}, epoch {:08x})",
        socket.display(),
        client.node_id(),
        client.epoch()
    );
    println!(
        "  capacity        {} in {} segment(s), {}",
        format_bytes(s.capacity_bytes),
        s.segments,
        if s.huge_pages != 0 {
            "huge pages"
        } else {
            "4 KiB pages"
        }
    );
    println!(
        "  used            {} ({:.1}%)",
        format_bytes(s.used_bytes),
        pct(s.used_bytes, s.capacity_bytes)
    );
    println!(
        "  largest free    {} (fragmentation {:.1}%)",
        format_bytes(s.largest_free_bytes),
        100.0 * s.fragmentation()
    );
    println!(
        "  objects         {} sealed, {} being written, {} pinned, {} deleted awaiting release",
        s.objects_sealed, s.objects_writing, s.objects_pinned, s.objects_delete_pending
    );
    println!("  leases          {}", s.leases);
    println!("  clients         {} (this one included)", s.clients);
    println!(
        "  evictions       {} ({})",
        s.evictions,
        format_bytes(s.evicted_bytes)
    );
    println!(
        "  backpressure    {} creates waited, {} failed full",
        s.creates_waited, s.creates_full
    );
    println!(
        "  crash recovery  {} unsealed objects aborted, {} leases reclaimed",
        s.aborted_on_disconnect, s.leases_reclaimed
    );
    Ok(())
}
