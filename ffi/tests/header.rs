//! `include/feedstore.h` is what cbindgen generates from `src/lib.rs` today: a change to the C
//! API that forgets the header fails here. `FEEDSTORE_BLESS=1` rewrites the header instead.

use std::path::Path;

#[test]
fn the_committed_header_is_current() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let config = cbindgen::Config::from_file(root.join("cbindgen.toml")).unwrap();
    let mut generated = Vec::new();
    cbindgen::Builder::new()
        .with_config(config)
        .with_src(root.join("src/lib.rs"))
        .generate()
        .expect("cbindgen parses src/lib.rs")
        .write(&mut generated);
    let generated = String::from_utf8(generated).unwrap();
    let path = root.join("include/feedstore.h");
    if std::env::var_os("FEEDSTORE_BLESS").is_some() {
        std::fs::write(&path, &generated).unwrap();
        return;
    }
    let committed = std::fs::read_to_string(&path).unwrap_or_default();
    assert!(
        committed == generated,
        "include/feedstore.h is stale; regenerate it with FEEDSTORE_BLESS=1 cargo test -p feedstore-ffi --test header"
    );
}
