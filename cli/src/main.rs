//! kerf CLI
fn main() {}
