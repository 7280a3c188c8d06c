//! Compiles the kubelet protos with protox, so no system `protoc` is needed.

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let files = [
        "proto/dra/v1/api.proto",
        "proto/dra/v1beta1/api.proto",
        "proto/pluginregistration/api.proto",
        "proto/dra-health/v1alpha1/api.proto",
    ];
    for file in files {
        println!("cargo:rerun-if-changed={file}");
    }
    let descriptors = protox::compile(files, ["proto"])?;
    tonic_prost_build::configure()
        .build_server(true)
        .build_client(true)
        .compile_fds(descriptors)?;
    Ok(())
}
